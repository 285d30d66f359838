-- Floodgate concurrency: units in flight per (client key, rule), each held under a lease until its
-- holder releases it or its time runs out.
--
-- State: one sorted set at fg:{<tag>}:<rule>/c/<client key>. Each lease is a member '<id>:<units>'
-- scored by the Unix ms at which it runs out; the member '#' is scored minus the units held, so
-- that the score range (0, now] finds the leases that ran out and never '#'. The key expires with
-- its last lease (PEXPIREAT at the latest expiry), so a holder that died leaks nothing for longer
-- than its lease, and an idle key costs nothing.
--
-- concurrency_acquire returns the verdict (allowed, limit, remaining, reset_at_ms, retry_after_ms)
-- and the write that takes the lease; check.lua commits it only if the check passes, as a token
-- bucket's. The maths is mirrored by core/src/algo/concurrency.rs (the embedded store).

-- Drops the leases that ran out by now, giving their units back; answers the units held.
local function concurrency_held(key, now)
  local gone = redis.call('ZRANGEBYSCORE', key, '(0', now)
  if #gone > 0 then
    local units = 0
    for i = 1, #gone do
      units = units + tonumber(string.match(gone[i], ':(%d+)$'))
    end
    redis.call('ZREMRANGEBYSCORE', key, '(0', now)
    redis.call('ZINCRBY', key, units, '#')
  end
  return -(tonumber(redis.call('ZSCORE', key, '#')) or 0)
end

-- When the last lease held runs out (now if none).
local function concurrency_last(key, now)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if #last == 0 or tonumber(last[2]) <= 0 then return now end
  return tonumber(last[2])
end

-- The figures for `cost` more units with `held` held: allowed when they fit, else the wait until the
-- soonest lease runs out, at most 1,000 ms (holders usually release long before).
local function concurrency_verdict(key, now, limit, held, cost)
  local remaining = limit - held
  if remaining < 0 then remaining = 0 end
  if held + cost <= limit then
    return { 1, limit, remaining, concurrency_last(key, now), 0 }
  end
  local soonest = redis.call('ZRANGEBYSCORE', key, '(0', '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  local at = now + 1
  if #soonest > 0 then at = tonumber(soonest[2]) end
  local retry = math.min(math.max(at - now, 1), 1000)
  return { 0, limit, remaining, concurrency_last(key, now), retry }
end

-- Whether `cost` more units would fit now; nothing changes (but leases that ran out are dropped).
local function concurrency_peek(key, now, limit, cost)
  return concurrency_verdict(key, now, limit, concurrency_held(key, now), cost)
end

-- Acquires `cost` units under lease `id` for `lease_ms`; the same lease held again with the same
-- units is renewed and always passes.
local function concurrency_acquire(key, now, limit, lease_ms, cost, id)
  local held = concurrency_held(key, now)
  local member = id .. ':' .. cost
  local expires = now + lease_ms
  local renew = redis.call('ZSCORE', key, member)
  if renew then
    local v = concurrency_verdict(key, now, limit, held, 0)
    local last = math.max(v[4], expires)
    return { 1, limit, v[3], last, 0 }, function()
      redis.call('ZADD', key, expires, member)
      redis.call('PEXPIREAT', key, last)
    end
  end
  local v = concurrency_verdict(key, now, limit, held, cost)
  if v[1] == 0 then
    return v, nil
  end
  local last = math.max(v[4], expires)
  return { 1, limit, v[3] - cost, last, 0 }, function()
    redis.call('ZADD', key, expires, member)
    redis.call('ZINCRBY', key, -cost, '#')
    redis.call('PEXPIREAT', key, last)
  end
end

-- Takes lease `id` of `cost` units for `lease_ms` whatever the limit: a lease the agent's fallback
-- granted while Redis was away, written back once it answers so that the fleet counts it. A lease
-- already held (the acquire that timed out ran after all) is renewed, never counted twice. Answers
-- the units held after it, or 0 when it was held already.
local function concurrency_take(key, now, lease_ms, cost, id)
  local held = concurrency_held(key, now)
  local member = id .. ':' .. cost
  local expires = now + lease_ms
  local last = math.max(concurrency_last(key, now), expires)
  local known = redis.call('ZSCORE', key, member)
  redis.call('ZADD', key, expires, member)
  redis.call('PEXPIREAT', key, last)
  if known then return 0 end
  redis.call('ZINCRBY', key, -cost, '#')
  return held + cost
end

-- Releases lease `id` of `cost` units, or (id false) up to `cost` units of whole leases, the soonest
-- to run out first. Answers the figures after it, allowed.
local function concurrency_release(key, now, limit, cost, id)
  local held = concurrency_held(key, now)
  local freed = 0
  if id then
    freed = redis.call('ZREM', key, id .. ':' .. cost) * cost
  else
    local leases = redis.call('ZRANGEBYSCORE', key, '(0', '+inf')
    local left = cost
    for i = 1, #leases do
      if left == 0 then break end
      local units = tonumber(string.match(leases[i], ':(%d+)$'))
      if units <= left then
        redis.call('ZREM', key, leases[i])
        left = left - units
      end
    end
    freed = cost - left
  end
  if freed > 0 then
    held = held - freed
    if redis.call('ZCARD', key) == 1 then
      redis.call('DEL', key)
    else
      redis.call('ZINCRBY', key, freed, '#')
    end
  end
  local v = concurrency_verdict(key, now, limit, held, 0)
  return { 1, limit, v[3], v[4], 0 }
end
