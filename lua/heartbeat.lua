-- Floodgate agent heartbeat: records this agent as live until now + ttl (Redis TIME) and returns how
-- many agents are live. Expired members are dropped here, and the set itself expires if every agent
-- stops, so nothing needs a clean-up job.
--
-- KEYS[1]  the live-agents sorted set, fg:{agents}:live
-- ARGV     agent id, ttl_ms, leaving (1 = remove this agent: clean shutdown)
-- returns  the number of live agents
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
if ARGV[3] == '1' then
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], ttl * 2)
return redis.call('ZCARD', KEYS[1])
