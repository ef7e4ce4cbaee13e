"""The node: residency and execution of versions, the batcher driver, the runtime and its sandboxed process,
packing, the archive and operator checks, the artifact cache, and the `runnode` process.
"""
