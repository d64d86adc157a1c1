"""Built-in models. Each is a plain nn.Module with its parallel plan declared beside it."""

from paratrain.models.plan_derivation import ParallelPlan, plan_of

__all__ = ["ParallelPlan", "plan_of"]
