"""Starting and keeping processes: the launcher, rendezvous, process-group set-up, preemption, the hang
watchdog and fault injection. Nothing here knows about models, data or layouts."""
