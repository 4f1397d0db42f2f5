// LNBWD_SHARD=K/N: a standalone check runs only the K-th of N interleaved parts of its cases, so
// that a slow run (a sanitizer's, above all racecheck's) can be spread over N processes side by
// side: the sanitizer scripts start one process a part. The parts are groups of cases that share
// their inputs and reference (a check's i-th group is part i % N), so no part computes another's
// reference. Unset: every case (part 0 of 1).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>

struct Shard {
  int k = 0, n = 1;
  bool mine(int64_t group) const { return group % n == k; }
  bool first() const { return k == 0; }   // for the cases that are no group's (a check's refusals)
};

// The process's part, from LNBWD_SHARD; exits with status 2 on a malformed value, so that a typo
// never passes as a check of every case.
inline Shard shard_from_env(const char* program) {
  Shard s;
  const char* env = std::getenv("LNBWD_SHARD");
  if (env == nullptr) return s;
  if (std::sscanf(env, "%d/%d", &s.k, &s.n) != 2 || s.n < 1 || s.k < 0 || s.k >= s.n) {
    std::fprintf(stderr, "%s: LNBWD_SHARD=%s: expected K/N with 0 <= K < N\n", program, env);
    std::exit(2);
  }
  return s;
}
