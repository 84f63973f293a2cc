-- Record a worker's capacity (fenced like every scheduler write).
-- KEYS[1] epoch key, KEYS[2] host hash, KEYS[3] hosts set
-- ARGV[1] epoch, ARGV[2] worker id, ARGV[3..6] cpu_milli, memory_mb, disk_mb, devices,
-- ARGV[7] device kind ("" for none), ARGV[8] JSON list of its device indices (the only
-- devices reserve.lua will pin on it)
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) ~= current then
  return {'stale_epoch', tostring(current)}
end
redis.call('HSET', KEYS[2], 'cpu_cap', ARGV[3], 'mem_cap', ARGV[4], 'disk_cap', ARGV[5],
           'dev_cap', ARGV[6], 'dev_kind', ARGV[7], 'dev_ids', ARGV[8] or '[]')
for _, d in ipairs({'cpu', 'mem', 'disk', 'dev'}) do redis.call('HSETNX', KEYS[2], d .. '_used', 0) end
redis.call('SADD', KEYS[3], ARGV[2])
return {'ok', '1'}
