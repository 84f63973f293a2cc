-- Commit every placement of one scheduling tick, all or nothing.
-- KEYS[1]            the fencing epoch key
-- KEYS[2k], KEYS[2k+1]  host hash and allocation hash of placement k (k = 1..n)
-- ARGV[1]            the caller's epoch
-- ARGV[k+1]          "attempt_key,cpu_milli,memory_mb" for placement k
-- Returns {"ok", n} or {"stale_epoch", current} or {"conflict", why}.
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) ~= current then
  return {'stale_epoch', tostring(current)}
end

-- Re-check capacity per host with every placement of this call added up.
local want_cpu, want_mem = {}, {}
for k = 2, #ARGV do
  local host_key, alloc_key = KEYS[2 * (k - 1)], KEYS[2 * (k - 1) + 1]
  local attempt, cpu, mem = string.match(ARGV[k], '^(.+),(%d+),(%d+)$')
  if redis.call('EXISTS', host_key) == 0 then
    return {'conflict', 'unknown host ' .. host_key}
  end
  if redis.call('HEXISTS', alloc_key, attempt) == 1 then
    return {'conflict', 'attempt ' .. attempt .. ' already reserved'}
  end
  want_cpu[host_key] = (want_cpu[host_key] or 0) + tonumber(cpu)
  want_mem[host_key] = (want_mem[host_key] or 0) + tonumber(mem)
end
for host_key, cpu in pairs(want_cpu) do
  local h = redis.call('HMGET', host_key, 'cpu_cap', 'mem_cap', 'cpu_used', 'mem_used')
  local cpu_cap, mem_cap = tonumber(h[1]), tonumber(h[2])
  local cpu_used, mem_used = tonumber(h[3] or '0'), tonumber(h[4] or '0')
  if cpu_used + cpu > cpu_cap or mem_used + want_mem[host_key] > mem_cap then
    return {'conflict', 'over capacity on ' .. host_key}
  end
end

for k = 2, #ARGV do
  local host_key, alloc_key = KEYS[2 * (k - 1)], KEYS[2 * (k - 1) + 1]
  local attempt, cpu, mem = string.match(ARGV[k], '^(.+),(%d+),(%d+)$')
  redis.call('HSET', alloc_key, attempt, cpu .. ',' .. mem)
  redis.call('HINCRBY', host_key, 'cpu_used', cpu)
  redis.call('HINCRBY', host_key, 'mem_used', mem)
end
return {'ok', tostring(#ARGV - 1)}
