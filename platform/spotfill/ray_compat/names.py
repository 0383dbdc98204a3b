"""Private module names spotfill imports by name, in a module that imports nothing (safe on any thread,
at any point of a process's start)."""

# Modules a warm worker process imports ahead of its actor (train.warm; hook warm_worker_setup_hook): Ray
# Train's worker actor class (the actor's creation imports it on the process's main thread; it imports no
# torch), and torch._dynamo, which torch's optimizers load on first use. Names only: importing them is the
# caller's, and a failed import there is ignored (the actor's or the optimizer's own import surfaces it).
RAY_TRAIN_WORKER_MODULE = "ray.train.v2._internal.execution.worker_group.worker"
DYNAMO_MODULE = "torch._dynamo"
# The process title of a Ray Train worker actor's process (Ray sets "ray::<actor class>"): a spare warming in
# SCHED_IDLE finds its node's training workers by it (train.spares.group_worker_pids).
RAY_TRAIN_WORKER_TITLE = "ray::RayTrainWorker"
