-- Release reservations whose attempts have exited (confirmed by the worker, or the worker
-- was declared dead). Releasing an attempt that holds nothing changes nothing.
-- KEYS[1]            the fencing epoch key
-- KEYS[2k], KEYS[2k+1]  host hash and allocation hash of release k
-- ARGV[1]            the caller's epoch; ARGV[k+1] the attempt key of release k
-- Returns {"ok", released} or {"stale_epoch", current}.
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) ~= current then
  return {'stale_epoch', tostring(current)}
end
local released = 0
for k = 2, #ARGV do
  local host_key, alloc_key = KEYS[2 * (k - 1)], KEYS[2 * (k - 1) + 1]
  local held = redis.call('HGET', alloc_key, ARGV[k])
  if held then
    local cpu, mem = string.match(held, '^(%d+),(%d+)$')
    redis.call('HDEL', alloc_key, ARGV[k])
    redis.call('HINCRBY', host_key, 'cpu_used', -tonumber(cpu))
    redis.call('HINCRBY', host_key, 'mem_used', -tonumber(mem))
    released = released + 1
  end
end
return {'ok', tostring(released)}
