"""The Lua scripts of the state store, each atomic inside Redis, with its contract (KEYS, ARGV, reply).

Kept apart from scheduler_service/store.py so that the store reads as the list of operations.
"""

from __future__ import annotations

# Admission in one atomic step: find the same request already there (same id and digest, live or finished
# with its stream kept: the caller re-attaches), refuse a live duplicate id or a full queue, else record and
# queue the request and count it in the worker's queue totals. Every replica runs the same check on the same
# counters, so the bound holds across replicas without any scan, and two replicas receiving the same request
# at once cannot both admit it. With the heartbeat checked, a request is never queued for a worker already
# gone: a router's view of the workers can be a tick old, and the engine loop of a departed worker hands over
# only what reached its queue while the worker still counted as alive.
#   KEYS: request hash, output stream, live set, inbox, queued hash, queue totals, digest, worker heartbeat
#   ARGV: record, worker id, request id, prompt tokens, max requests (0 = none), max tokens (0 = none),
#         digest ("" for a server-chosen id: never re-sent, nothing to remember), "1" to require the heartbeat
#   returns {status, queued requests, queued tokens}; status 0 admitted, 1 duplicate, 2 / 3 request / token
#   limit, 4 the same request exists (attach to its stream), 5 the worker is gone
ADMIT_LUA = """
local live = redis.call('EXISTS', KEYS[1]) == 1
if ARGV[7] ~= '' and redis.call('GET', KEYS[7]) == ARGV[7] and (live or redis.call('EXISTS', KEYS[2]) == 1) then
  return {4, 0, 0}
end
if live then return {1, 0, 0} end
if ARGV[8] == '1' and redis.call('EXISTS', KEYS[8]) == 0 then return {5, 0, 0} end
local reqs = tonumber(redis.call('HGET', KEYS[6], 'requests') or '0')
local toks = tonumber(redis.call('HGET', KEYS[6], 'tokens') or '0')
local n = tonumber(ARGV[4])
local max_reqs = tonumber(ARGV[5])
local max_toks = tonumber(ARGV[6])
if max_reqs > 0 and reqs >= max_reqs then return {2, reqs, toks} end
-- An empty queue takes any request, so a prompt longer than the token bound is not refused forever.
if max_toks > 0 and reqs > 0 and toks + n > max_toks then return {3, reqs, toks} end
redis.call('DEL', KEYS[2])
if ARGV[7] == '' then redis.call('DEL', KEYS[7]) else redis.call('SET', KEYS[7], ARGV[7]) end
redis.call('HSET', KEYS[1], 'request', ARGV[1], 'worker', ARGV[2], 'state', 'queued')
redis.call('SADD', KEYS[3], ARGV[3])
redis.call('RPUSH', KEYS[4], ARGV[1])
redis.call('HSET', KEYS[5], ARGV[3], n)
redis.call('HINCRBY', KEYS[6], 'requests', 1)
redis.call('HINCRBY', KEYS[6], 'tokens', n)
return {0, reqs + 1, toks + n}
"""

# Requests leave the queue count when they are first scheduled (they appear in the running or swapped
# snapshot) or finish (aborted or failed while waiting). Idempotent: ids no longer counted are skipped.
#   KEYS: queued hash, queue totals; ARGV: request ids
DEQUEUE_LUA = """
for _, id in ipairs(ARGV) do
  local n = redis.call('HGET', KEYS[1], id)
  if n then
    redis.call('HDEL', KEYS[1], id)
    redis.call('HINCRBY', KEYS[2], 'requests', -1)
    redis.call('HINCRBY', KEYS[2], 'tokens', -tonumber(n))
  end
end
return 0
"""

# A step's appends in one call instead of one command each (a decode step has one token list and one
# output stream per request): RPUSH values onto lists (new tokens, new block ids), then XADD the output
# messages, each under the entry id that encodes its index in its request's stream (see stream_index),
# so a client can resume at any index on any replica. XLEN is the next index because the stream is
# append-only. Runs inside the commit's MULTI/EXEC.
#   KEYS: the lists, then one output stream per message
#   ARGV: number of lists; for each list, its number of values and the values; then the serialized
#         messages, in the order of their streams
APPEND_STEP_LUA = """
local lists = tonumber(ARGV[1])
local a = 2
for i = 1, lists do
  local last = a + tonumber(ARGV[a])
  -- unpack() is bounded by Lua's C stack: push long lists in chunks.
  for first = a + 1, last, 4096 do
    redis.call('RPUSH', KEYS[i], unpack(ARGV, first, math.min(first + 4095, last)))
  end
  a = last + 1
end
for i = lists + 1, #KEYS do
  redis.call('XADD', KEYS[i], '0-' .. (redis.call('XLEN', KEYS[i]) + 1), 'm', ARGV[a])
  a = a + 1
end
return 0
"""

# Aborts go to the engine loop of the worker that serves the request now: a request handed over to
# another worker is no longer the business of the worker that admitted it. A request that is gone
# (finished, never admitted) gets nothing.
#   KEYS: the requests' hashes; ARGV: the aborts key of a worker split around its id (head, tail), a
#         worker id whose requests are skipped ("" for none), then the request ids in the order of KEYS
#   returns how many aborts were queued
ROUTE_ABORTS_LUA = """
local queued = 0
for i = 1, #KEYS do
  local worker = redis.call('HGET', KEYS[i], 'worker')
  if worker and worker ~= ARGV[3] then
    redis.call('RPUSH', ARGV[1] .. worker .. ARGV[2], ARGV[3 + i])
    queued = queued + 1
  end
end
return queued
"""

# A request handed over to another worker moves only if that worker is still alive: the giving loop's
# router saw it alive up to a tick ago, and a worker that died since would never serve it (its own loop
# may have ended already). Otherwise the request comes back to the giving worker's inbox, still marked
# handed over, and its loop recomputes it or hands it over again with a fresher view.
#   KEYS: request hash, giver's live set, giver's inbox, target's live set, target's inbox, target's heartbeat
#   ARGV: the record for the target, the record for the giver, the target's id, the request id
#   returns 1 when moved, 0 when it came back
HAND_OVER_LUA = """
if redis.call('EXISTS', KEYS[6]) == 1 then
  redis.call('HSET', KEYS[1], 'request', ARGV[1], 'worker', ARGV[3])
  redis.call('SREM', KEYS[2], ARGV[4])
  redis.call('SADD', KEYS[4], ARGV[4])
  redis.call('RPUSH', KEYS[5], ARGV[1])
  return 1
end
redis.call('HSET', KEYS[1], 'request', ARGV[2])
redis.call('RPUSH', KEYS[3], ARGV[2])
return 0
"""
