-- Record a worker's capacity (fenced like every scheduler write).
-- KEYS[1] epoch key, KEYS[2] host hash, KEYS[3] hosts set
-- ARGV[1] epoch, ARGV[2] worker id, ARGV[3] cpu_milli, ARGV[4] memory_mb
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) ~= current then
  return {'stale_epoch', tostring(current)}
end
redis.call('HSET', KEYS[2], 'cpu_cap', ARGV[3], 'mem_cap', ARGV[4])
redis.call('HSETNX', KEYS[2], 'cpu_used', 0)
redis.call('HSETNX', KEYS[2], 'mem_used', 0)
redis.call('SADD', KEYS[3], ARGV[2])
return {'ok', '1'}
