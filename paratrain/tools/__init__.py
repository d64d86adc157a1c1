"""Commands that are not on the training path: report, bench comm, verify, export, pipeline show.
They may import anything; nothing on the training path imports them."""
