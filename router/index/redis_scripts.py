"""The Redis index's server-side part: its Lua scripts (lookup, record, remove, clear), the
packing of block hashes they read, the model hash tag and the bucket count. The key schema
and the generation/bucket design they implement are described in :mod:`router.index.redis`,
which re-exports every name here. Pure (text and arithmetic).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

GENERATIONS = 8
BUCKET_TARGET = 64

LOOKUP_LUA = """
local meta = redis.call('HGETALL', KEYS[1])
local hs = ARGV[1]
local prefix = ARGV[2]
local n = #hs / 8
if n == 0 then return {} end
local byte, sub, floor = string.byte, string.sub, math.floor
-- per replica: generation, bucket count, generations kept (fields g:R, b:R, w:R)
local g, nb, w = {}, {}, {}
for i = 1, #meta, 2 do
  local f = meta[i]
  local k, c = byte(f, 1, 2)
  if c == 58 then
    if k == 103 then g[sub(f, 3)] = tonumber(meta[i + 1])
    elseif k == 98 then nb[sub(f, 3)] = tonumber(meta[i + 1])
    elseif k == 119 then w[sub(f, 3)] = tonumber(meta[i + 1]) end
  end
end
-- block i: its 8 bytes and the 24 bits that pick its bucket (computed once for all replicas)
local hb, hv = {}, {}
local function has(kp, buckets, stale, i)
  local h = hb[i]
  if not h then
    h = sub(hs, i * 8 - 7, i * 8)
    local b1, b2, b3 = byte(h, 1, 3)
    hb[i] = h
    hv[i] = b1 + b2 * 256 + b3 * 65536
  end
  local v = redis.call('HGET', kp .. (hv[i] % buckets), h)
  return v and tonumber(v) > stale
end
-- pivots: up to 8 distinct lengths already found for other replicas, most recent first;
-- a holder tries up to two (has(L), then has(L+1)) before bisecting, so replicas sharing a
-- system prompt, or all holding the chain, cost ~3 probes each instead of ~log2 n. While
-- pivots do not pay (the last two holders that tried were not settled by them) only every
-- 4th holder tries them: replicas holding all different lengths waste few probes.
local known, misses, holders = {}, 0, 0
local out = {}
for rep, gen in pairs(g) do
  local buckets, keep = nb[rep], w[rep]
  if buckets and keep then
    local kp = prefix .. rep .. ':'
    local stale = gen - keep
    if has(kp, buckets, stale, 1) then
      holders = holders + 1
      local lo, hi = 1, n
      if misses < 2 or holders % 4 == 0 then
        local tries = 0
        for j = 1, #known do
          if lo >= hi or tries >= 2 then break end
          local L = known[j]
          if L > lo and L <= hi then
            tries = tries + 1
            if has(kp, buckets, stale, L) then lo = L else hi = L - 1 end
          end
          if L == lo and lo < hi then
            if has(kp, buckets, stale, L + 1) then lo = L + 1 else hi = L end
          end
        end
        if tries > 0 then
          if lo < hi then misses = misses + 1 else misses = 0 end
        end
      end
      if lo < hi and hi == n then
        if has(kp, buckets, stale, n) then lo = n else hi = n - 1 end
      end
      while lo < hi do
        local mid = floor((lo + hi + 1) / 2)
        if has(kp, buckets, stale, mid) then lo = mid else hi = mid - 1 end
      end
      out[#out + 1] = rep
      out[#out + 1] = lo
      for j = 1, #known do
        if known[j] == lo then
          table.remove(known, j)
          break
        end
      end
      table.insert(known, 1, lo)
      known[9] = nil
    end
  end
end
return out
"""

RECORD_LUA = """
local meta = KEYS[1]
local rep = ARGV[1]
local hs = ARGV[2]
local kp = ARGV[3] .. rep .. ':'
local cap = tonumber(ARGV[4])
local ttl = tonumber(ARGV[5])
local maxgen = tonumber(ARGV[6])
local target = tonumber(ARGV[7])
local now = tonumber(redis.call('TIME')[1])
local st = redis.call('HMGET', meta, 'g:' .. rep, 'n:' .. rep, 'b:' .. rep, 'c:' .. rep, 't:' .. rep, 'w:' .. rep)
local g = tonumber(st[1]) or 0
local cnt = tonumber(st[2]) or 0
local want = math.max(1, math.ceil(cap / target))
local nb = tonumber(st[3]) or want
local cur = tonumber(st[4]) or 0
local t0 = tonumber(st[5]) or now
local changed = st[1] == false
if nb ~= want then
  -- the capacity changed (known only after the first record): move the live entries to
  -- the bucket count it calls for, once, so buckets keep ~target entries
  local live = g - (tonumber(st[6]) or maxgen)
  local moved = {}
  for b = 0, nb - 1 do
    local key = kp .. b
    local all = redis.call('HGETALL', key)
    if #all > 0 then
      redis.call('DEL', key)
      for j = 1, #all, 2 do
        if tonumber(all[j + 1]) > live then
          local h = all[j]
          local b1, b2, b3 = string.byte(h, 1, 3)
          local to = kp .. ((b1 + b2 * 256 + b3 * 65536) % want)
          redis.call('HSET', to, h, all[j + 1])
          moved[to] = true
        end
      end
    end
  end
  for key in pairs(moved) do redis.call('PEXPIRE', key, ttl) end
  nb = want
  cur = 0
  changed = true
end
if now - t0 >= ttl / 2000 then
  -- a generation lasts at most ttl/2: blocks in use are rewritten (and their TTL renewed)
  g = g + 1
  cnt = 0
  t0 = now
  changed = true
end
local w = math.max(1, math.min(maxgen, cap))
local S = math.max(1, math.floor(cap / w))
local n = #hs / 8
local every = ARGV[8] == '1'
local function key_of(i)
  local h = string.sub(hs, i * 8 - 7, i * 8)
  local b1, b2, b3 = string.byte(h, 1, 3)
  return kp .. ((b1 + b2 * 256 + b3 * 65536) % nb), h
end
local function current(i)
  local key, h = key_of(i)
  local v = redis.call('HGET', key, h)
  return v and tonumber(v) == g
end
-- Blocks already in the current generation form a prefix of the chain (a chain is written
-- tail-first, so a current block's whole prefix was written after it): find its end.
-- Not after a removal: an engine eviction can leave a hole in the middle of a chain whose
-- tail is current, and the search would skip it for good. So a record of blocks the
-- engine reports stored (every = 1) checks each block; the router's own records (which
-- re-record whole prompts, possibly thousands of blocks) keep the search.
local done = 0
if every then
  done = -1
elseif n > 0 and current(n) then
  done = n
elseif n > 1 then
  local lo, hi = 0, n - 1
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if current(mid) then lo = mid else hi = mid - 1 end
  end
  done = lo
end
local touched = {}
local new = 0
for i = n, math.max(done, 0) + 1, -1 do
  local key, h = key_of(i)
  if done < 0 then
    local v = redis.call('HGET', key, h)
    if v and tonumber(v) == g then key = nil end
  end
  if key then
    if cnt >= S then
      g = g + 1
      cnt = 0
    end
    redis.call('HSET', key, h, g)
    cnt = cnt + 1
    new = new + 1
    touched[key] = true
  end
end
for key in pairs(touched) do redis.call('PEXPIRE', key, ttl) end
local floor = g - w
-- one full pass over the buckets per 2 generations: a stale entry lives at most 2
-- generations past its last, so up to (w + 2)/w x C entries; half the HGETALLs of a pass
-- per generation (the sweep was the largest part of recording fresh blocks)
local sweep = math.min(nb, math.ceil(new * nb / (2 * S)))
for s = 1, sweep do
  local key = kp .. cur
  cur = (cur + 1) % nb
  local all = redis.call('HGETALL', key)
  for j = 1, #all, 2 do
    if tonumber(all[j + 1]) <= floor then redis.call('HDEL', key, all[j]) end
  end
end
if new > 0 or changed then
  redis.call('HSET', meta, 'g:' .. rep, g, 'n:' .. rep, cnt, 'b:' .. rep, nb, 'c:' .. rep, cur,
             'w:' .. rep, w, 't:' .. rep, t0)
  redis.call('PEXPIRE', meta, ttl)
end
return new
"""

REMOVE_LUA = """
local meta = KEYS[1]
local rep = ARGV[1]
local hs = ARGV[2]
local kp = ARGV[3] .. rep .. ':'
local nb = tonumber(redis.call('HGET', meta, 'b:' .. rep))
if not nb then return 0 end
local gone = 0
for i = 1, #hs / 8 do
  local h = string.sub(hs, i * 8 - 7, i * 8)
  local b1, b2, b3 = string.byte(h, 1, 3)
  gone = gone + redis.call('HDEL', kp .. ((b1 + b2 * 256 + b3 * 65536) % nb), h)
end
return gone
"""

CLEAR_LUA = """
local meta = KEYS[1]
local rep = ARGV[1]
local w = tonumber(redis.call('HGET', meta, 'w:' .. rep))
if not w then return 0 end
redis.call('HINCRBY', meta, 'g:' .. rep, w)
redis.call('HSET', meta, 'n:' .. rep, 0)
return 1
"""


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """Block hashes as one binary string, 8 little-endian bytes each."""
    try:
        return array("Q", hashes).tobytes()
    except OverflowError:
        return array("Q", [h & 0xFFFFFFFFFFFFFFFF for h in hashes]).tobytes()


def model_tag(model: str) -> str:
    """The model's name as a Cluster hash tag body (braces would end the tag early)."""
    return model.replace("{", "(").replace("}", ")")


def buckets_for(capacity: int) -> int:
    """Bucket count the record script picks for a replica of ``capacity`` blocks."""
    return max(1, math.ceil(capacity / BUCKET_TARGET))
