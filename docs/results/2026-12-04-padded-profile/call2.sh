# 2026-12-04 session 26, call 2: Call B of ../2026-12-04-padded-tree/next_calls.sh as written there (32k end to end,
# goal: round <= 8.5 ms; batch 4 at 16k; both in generate()'s default reproducible compile, the tree padded to 72):
sed -n '/^# Call B/,$p' docs/results/2026-12-04-padded-tree/next_calls.sh | bash
