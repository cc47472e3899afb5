source .gpu/setup.sh
export LONGSPEC_FIXTURE_DRAFT=$PWD/.gpu/fx/code-lm-draft-ref
left start
timeout 200 python -m pytest -q -m gpu tests/test_gpu_e2e.py -k "test_bf16_speculative_matches_greedy and (auto or mosaic) and not 32k" 2>&1 | tail -3
left e2e done
timeout 200 python -m pytest -q -m gpu tests/test_gpu_repro.py -k two_fresh 2>&1 | tail -3
left repro done
