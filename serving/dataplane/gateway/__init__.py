"""The gateway: authentication against the snapshot, the quota gate, routing to a version, shadow mirroring, and
the routing snapshot with its Redis follower.
"""
