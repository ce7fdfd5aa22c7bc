"""Test set-up, fixed before jax is imported: 8 fake CPU devices, full-precision matmuls,
XLA:CPU's fast-compile settings (tests are dominated by compile time, not run time), and one
persistent compilation cache for the whole run, shared by both pytest-xdist workers and the
commands tests start (`XLA_CACHE`), so engines rebuilt with the same config in another test,
file, worker or process (CLI tests, servers, restored checkpoints) reuse compiled programs.
A test that leaves one of jax's process-wide settings changed fails, naming it: the change would
outlive it in its worker and break whichever test that worker runs next."""

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# The first process to load this file (pytest's controller, before it starts its workers, which
# inherit the variable) makes the directory and removes it when it exits.
_CACHE_VARIABLE = "K3TEXT_TEST_XLA_CACHE"
if _CACHE_VARIABLE not in os.environ:
    os.environ[_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="k3text-test-xla-cache-")
    atexit.register(shutil.rmtree, os.environ[_CACHE_VARIABLE], ignore_errors=True)
XLA_CACHE = os.environ[_CACHE_VARIABLE]
jax.config.update("jax_compilation_cache_dir", XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
# A size bound turns on the cache's file lock, so processes writing and reading the same entry
# at once never see half a file.
jax.config.update("jax_compilation_cache_max_size", 16 * 2**30)


# The settings that change what a program compiles to, or what the compilation cache keys and
# keeps (k3text sets some of them: sharding.maybe_initialize_distributed, enable_compilation_cache).
_PROCESS_WIDE = ("jax_default_matmul_precision", "jax_enable_x64", "jax_enable_compilation_cache",
                 "jax_include_full_tracebacks_in_locations",
                 "jax_compilation_cache_include_metadata_in_key", "jax_compilation_cache_dir",
                 "jax_persistent_cache_min_compile_time_secs",
                 "jax_cpu_collectives_implementation")


@pytest.fixture(autouse=True)
def _jax_settings_left_as_found():
    before = {name: getattr(jax.config, name) for name in _PROCESS_WIDE}
    yield
    changed = {name: (value, getattr(jax.config, name)) for name, value in before.items()
               if getattr(jax.config, name) != value}
    for name, (value, _) in changed.items():  # so one leak does not fail the tests after it
        jax.config.update(name, value)
    assert not changed, f"the test changed jax settings (name: (before, after)): {changed}"
