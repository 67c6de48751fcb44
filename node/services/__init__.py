"""What a node does besides moving microbatches: admission and bans (guard), outer
synchronisation of a stage's replicas (sync), keeping every stage filled (recovery, with
statefetch), and choosing and balancing stages (balance). Each service receives the node's
context and the callables it uses, never the daemon."""
