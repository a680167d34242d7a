"""Starting a run's roles on a cluster engine (Slurm, Kubernetes) and preparing nodes for it."""
