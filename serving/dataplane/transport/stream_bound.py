"""The bound on a version's request stream, in entries and in bytes, kept by Redis itself.

Every gateway adds to the same stream, so no gateway's own count bounds it: a counter of the bytes the
stream holds sits beside it (`bytes_key`, in the stream's hash slot), and two Lua scripts keep it exact:

- `ADD`: XADD only if the stream holds fewer than its entry bound and the entry fits its byte bound; the
  counter grows by the entry's size in the same step. Past either bound, nothing is added, the version's
  refusal counter (`refused_key`) grows by one, and the gateway answers 503 with Retry-After. No MAXLEN
  trimming: a trimmed entry would be a request dropped unseen.
- `ACK`: a node's XACK and XDEL of the entries it answered, and the counter less the size of each entry
  that XDEL actually removed, so a pipeline sent twice after a broken connection takes nothing off twice.
- `HAND_BACK`: a node that read an entry of a version it no longer serves (a placement moved it away between
  the read and the serve) puts it back at the stream's end for the node that does, in one step.

The refusal counter counts the requests gateways refused before the stream (here, and by their own bounds and
admission, which add theirs every second: `serving.dataplane.transport.streams`): the stream's `entries-added`
counts only what got in, and the autoscaler sizes a version for what was asked of it, the two together
(`autoscaling.observe`). Without it, a fleet under overload would see only what its own admission let through,
about what it already serves, and scale out a target utilisation's step per lead time instead of to the demand.

Drift (an entry removed some other way: a test's XDEL, an operator's XTRIM) is healed when the stream is
empty, since then it holds nothing, whatever the counter says; the counter never goes below 0.
"""

from __future__ import annotations

from serving.dataplane.transport.stream_codec import request_stream


def bytes_key(key: str) -> str:
    """The byte counter of version `key`'s stream, in the same Redis Cluster slot (its hash tag)."""
    return request_stream(key) + ":bytes"


def refused_key(key: str) -> str:
    """The count of version `key`'s requests refused before its stream, in the same Redis Cluster slot."""
    return request_stream(key) + ":refused"


# KEYS: the stream, its byte counter, its refusal counter. ARGV: the byte bound, the entry bound, the field, the
# entry. Returns {1, entries, bytes} once added, {0, entries, bytes} when refused (what the stream holds).
ADD = """
local n = redis.call('XLEN', KEYS[1])
local held = 0
if n > 0 then held = tonumber(redis.call('GET', KEYS[2]) or '0') end
local size = string.len(ARGV[4])
if n >= tonumber(ARGV[2]) or held + size > tonumber(ARGV[1]) then
  redis.call('INCR', KEYS[3])
  return {0, n, held}
end
redis.call('XADD', KEYS[1], '*', ARGV[3], ARGV[4])
redis.call('SET', KEYS[2], held + size)
return {1, n + 1, held + size}
"""

# KEYS: the stream, its byte counter. ARGV: the group, then pairs of entry id and size.
# Returns the bytes taken off the counter.
ACK = """
local freed = 0
for i = 2, #ARGV, 2 do
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  if redis.call('XDEL', KEYS[1], ARGV[i]) == 1 then freed = freed + tonumber(ARGV[i + 1]) end
end
if redis.call('XLEN', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[2])
elseif freed > 0 then
  if redis.call('DECRBY', KEYS[2], freed) < 0 then redis.call('SET', KEYS[2], 0) end
end
return freed
"""


# KEYS: the stream, its byte counter. ARGV: the group, the entry id, the field, the entry.
# The entry acknowledged and deleted, and the same bytes added again as a new entry at the stream's end, for
# the other consumers: the counter is left as it is (what left comes back). Nothing is added when XDEL found
# nothing (a resend after a broken connection, or the entry already gone). Returns 1 when handed back.
HAND_BACK = """
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if redis.call('XDEL', KEYS[1], ARGV[2]) == 0 then return 0 end
redis.call('XADD', KEYS[1], '*', ARGV[3], ARGV[4])
return 1
"""


def add_args(key: str, max_bytes: int, max_entries: int, field: bytes, message: bytes) -> tuple:
    """The EVAL command (for `redis_pipe.Pipe.send`) that adds `message` to version `key`'s stream within bounds."""
    keys = (request_stream(key), bytes_key(key), refused_key(key))
    return ("EVAL", ADD, len(keys), *keys, max_bytes, max_entries, field, message)


def ack_args(key: str, group: str, answered: list[tuple[bytes, int]]) -> tuple:
    """The EVAL command that acknowledges and deletes `answered` (entry id, size) of version `key`'s stream."""
    flat = [item for pair in answered for item in pair]
    return ("EVAL", ACK, 2, request_stream(key), bytes_key(key), group, *flat)


def hand_back_args(key: str, group: str, entry_id: bytes, field: bytes, message: bytes) -> tuple:
    """The EVAL command that hands entry `entry_id` of version `key`'s stream back to the group's other consumers."""
    return ("EVAL", HAND_BACK, 2, request_stream(key), bytes_key(key), group, entry_id, field, message)
