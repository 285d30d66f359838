-- Floodgate token bucket: capacity `burst`, refilled at limit / window tokens per millisecond.
--
-- State per (client key, rule): a hash {t = tokens, ts = last update in ms} at fg:{<tag>}:<rule>:k:<client
-- key>, the tag being the client's (so one client's keys share a slot). The key expires when its
-- bucket would be full again, which is the same as having no key, so nothing needs a clean-up job.
--
-- token_bucket(key, now, limit, window, burst, cost) returns the verdict
-- (allowed, limit = burst, remaining, reset_at_ms, retry_after_ms) and the write that would take the
-- cost. check.lua calls it for every item first and commits only if every enforced item passes (or,
-- for a write-back, unconditionally: the bucket may then go below zero, a debt that refills first).
--
-- The maths is mirrored line for line by core/src/algo/token_bucket.rs (the embedded store).
local function token_bucket_tokens(key, now, rate, burst)
  local v = redis.call('HMGET', key, 't', 'ts')
  local tokens = tonumber(v[1])
  local ts = tonumber(v[2])
  if tokens == nil or ts == nil then
    tokens = burst
  elseif now > ts then
    tokens = tokens + (now - ts) * rate
    if tokens > burst then tokens = burst end
  end
  return tokens
end

local function token_bucket(key, now, limit, window, burst, cost)
  local rate = limit / window
  local tokens = token_bucket_tokens(key, now, rate, burst)

  local after = tokens - cost
  local after_reset = now + math.ceil((burst - after) / rate)
  local commit = function()
    redis.call('HSET', key, 't', after, 'ts', now)
    redis.call('PEXPIREAT', key, after_reset + 1)
  end
  if tokens >= cost then
    return { 1, burst, math.floor(after), after_reset, 0 }, commit
  end

  local retry
  if cost > burst then
    retry = window
  else
    retry = math.ceil((cost - tokens) / rate)
  end
  if retry < 1 then retry = 1 end
  local reset = now + math.ceil((burst - tokens) / rate)
  if tokens < 0 then tokens = 0 end
  return { 0, burst, math.floor(tokens), reset, retry }, commit
end

-- Gives `units` back (a check that consumed them was rejected on another shard): the bucket never
-- holds more than `burst`.
local function token_bucket_give_back(key, now, limit, window, burst, units)
  local rate = limit / window
  local tokens = token_bucket_tokens(key, now, rate, burst) + units
  if tokens >= burst then
    redis.call('DEL', key)
    return
  end
  redis.call('HSET', key, 't', tokens, 'ts', now)
  redis.call('PEXPIREAT', key, now + math.ceil((burst - tokens) / rate) + 1)
end

-- A peek: what `cost` would do now, changing nothing (core/src/algo/token_bucket.rs
-- `token_bucket_peek`): the verdict with the tokens now as remaining.
local function token_bucket_peek(key, now, limit, window, burst, cost)
  local verdict = token_bucket(key, now, limit, window, burst, cost)
  if verdict[1] == 0 then
    return verdict
  end
  local rate = limit / window
  local tokens = token_bucket_tokens(key, now, rate, burst)
  return { 1, burst, math.floor(tokens), now + math.ceil((burst - tokens) / rate), 0 }
end

-- A charge: `cost` taken whatever is left (`token_bucket_charge`); the bucket may go below zero, a
-- debt refilled before anything else passes. Allowed (1 | 0) whether the bucket is still not in
-- debt (committed either way); remaining floored at 0.
local function token_bucket_charge(key, now, limit, window, burst, cost)
  local rate = limit / window
  -- The debt stops where the bucket would take 100 years to refill (core/src/algo/token_bucket.rs
  -- MAX_FILL_MS): the reset stays a time PEXPIREAT takes.
  local floor = burst - 3153600000000 * rate
  local after = token_bucket_tokens(key, now, rate, burst) - cost
  if after < floor then after = floor end
  redis.call('HSET', key, 't', after, 'ts', now)
  redis.call('PEXPIREAT', key, now + math.ceil((burst - after) / rate) + 1)
  local remaining = math.floor(after)
  if remaining < 0 then remaining = 0 end
  local reset = now + math.ceil((burst - after) / rate)
  if after >= 0 then
    return { 1, burst, remaining, reset, 0 }
  end
  -- In debt: when one unit could pass again.
  local retry = math.ceil((1 - after) / rate)
  if retry < 1 then retry = 1 end
  return { 0, burst, remaining, reset, retry }
end
