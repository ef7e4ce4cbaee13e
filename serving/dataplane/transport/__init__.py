"""Gateway to node: the in-process transport (embedded), Redis Streams (distributed) with its codec and
pipelining, and the fleet as Redis holds it.
"""
