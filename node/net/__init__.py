"""The node's network helpers: frames over HTTP (transport), emulated latency and uplinks
for testbeds (netem), and the address a node announces (addresses)."""
