"""Which strategies exist for a model on a cluster, and how an Optuna trial samples one."""
