-- Floodgate calendar quota: an exact count per (client key, rule) per calendar period.
--
-- State: fields of bucketed hashes like the sliding window's, one hash per (rule, bucket, period):
-- <prefix>:q<period start ms>, field = the client key, value = the count. The agent computes the
-- period (its start and end, Unix ms, from the rule's time zone) and passes the period's hash in
-- KEYS and its end; the hash expires a minute after the period ends. A period's counts never move
-- to the next: a new period is a new hash.
--
-- quota returns the verdict (allowed, limit, remaining, reset_at_ms = the period's end,
-- retry_after_ms = until then) and the write that counts the cost; check.lua commits it only if the
-- check passes. The maths is mirrored by core/src/algo/quota.rs (the embedded store).

local function quota_answer(allowed, limit, after, now, period_end)
  local remaining = limit - after
  if remaining < 0 then remaining = 0 end
  if allowed then
    return { 1, limit, remaining, period_end, 0 }
  end
  return { 0, limit, remaining, period_end, math.max(period_end - now, 1) }
end

local function quota(key, field, now, limit, period_end, cost)
  local count = tonumber(redis.call('HGET', key, field)) or 0
  if count + cost > limit then
    return quota_answer(false, limit, count, now, period_end), nil
  end
  return quota_answer(true, limit, count + cost, now, period_end), function()
    redis.call('HINCRBY', key, field, cost)
    redis.call('PEXPIREAT', key, period_end + 60000)
  end
end

local function quota_peek(key, field, now, limit, period_end, cost)
  local count = tonumber(redis.call('HGET', key, field)) or 0
  local v = quota_answer(count + cost <= limit, limit, count, now, period_end)
  return v
end

local function quota_charge(key, field, now, limit, period_end, cost)
  local after = redis.call('HINCRBY', key, field, cost)
  redis.call('PEXPIREAT', key, period_end + 60000)
  return quota_answer(after <= limit, limit, after, now, period_end)
end

-- A write-back (units > 0) or a take-back (units < 0) into the period whose hash is `key`: the
-- count after it.
local function quota_adjust(key, field, period_end, units)
  local after = redis.call('HINCRBY', key, field, units)
  if after <= 0 then
    redis.call('HDEL', key, field)
    after = 0
  end
  redis.call('PEXPIREAT', key, period_end + 60000)
  return after
end
