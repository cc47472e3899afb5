source .gpu/setup.sh
(cd .gpu/ovl && LS_MEM_REGS=24 PYTHONPATH=$PWD timeout 400 python -m pytest -q -m gpu -p no:cacheprovider \
  "tests/test_mosaic_cache.py::test_compiled_kernel_on_gpu_matches_float32_reference[padded-ovl-wg3]" \
  "tests/test_mosaic_cache.py::test_compiled_kernel_on_gpu_matches_float32_reference[padded-ovl-short]" \
  "tests/test_mosaic_cache.py::test_compiled_kernel_on_gpu_matches_float32_reference[llama-ovl-wg2]" \
  "tests/test_mosaic_cache.py::test_compiled_kernel_on_gpu_matches_float32_reference[padded-ovl-wg2-bk64]" \
  ) > $OUT/ovl_tests.txt 2>&1; tail -4 $OUT/ovl_tests.txt | cut -c1-400; left "ovl tests"
