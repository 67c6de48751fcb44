"""What a node does with a microbatch, by the stage it serves: the head or a block stage."""
