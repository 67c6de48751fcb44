"""The torch side of a node: the model and its split, the stage runner on the compute thread,
weight stashing, the outer optimizer's state, own-speed benchmark, export, checkpoints and
the operator profile. Nothing here knows the network or the daemon."""
