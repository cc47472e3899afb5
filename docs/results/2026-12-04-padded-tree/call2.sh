# 2026-12-04 session 25: GPU tests of the padded verification (verify_node_multiple 8 by default)
source .gpu/setup.sh
timeout 420 python -m pytest -q -m gpu tests/test_gpu_e2e.py -k "test_bf16_speculative_matches_greedy and not 32k or (32k and auto)" -p no:cacheprovider 2>&1 | tail -8; left "e2e"
timeout 120 python -m pytest -q -m gpu tests/test_gpu_repro.py -p no:cacheprovider 2>&1 | tail -4; left "repro"
