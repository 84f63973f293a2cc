-- Acquire or renew the scheduler leader lease.
-- KEYS[1] leader key, KEYS[2] epoch key; ARGV[1] scheduler id, ARGV[2] ttl in ms,
-- ARGV[3] (optional) the epoch floor: the highest epoch already used, as the event log
-- shows it. After a failover to a replica that missed the last increment, the epoch key can
-- be behind the log; an epoch from here is always above both, so no two leaders share one.
-- A new holder takes a new epoch, so every write of the previous holder is refused; the
-- holder itself takes a fresh one when its epoch is not above the floor.
-- Returns the holder's epoch, or 0 when another scheduler holds the lease.
local floor = tonumber(ARGV[3] or '0')
local holder = redis.call('GET', KEYS[1])
if holder then
  local id, epoch = string.match(holder, '^(.*):(%d+)$')
  if id ~= ARGV[1] then
    return 0
  end
  if tonumber(epoch) > floor then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(epoch)
  end
end
local current = tonumber(redis.call('GET', KEYS[2]) or '0')
local epoch = math.max(current, floor) + 1
redis.call('SET', KEYS[2], epoch)
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. epoch, 'PX', ARGV[2])
return epoch
