"""The repository root on ``sys.path`` (pytest's ``pythonpath``, ``python -c`` / ``python -m`` started
there) must not shadow Hugging Face's ``kernels`` distribution, which transformers imports when it is
installed: ``kernels/`` is ``conserve.kernels`` and hands a top-level ``import kernels`` over to the
installed distribution (``kernels/__init__.py``)."""
import importlib.metadata
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = os.path.join(ROOT, "kernels", "__init__.py")


def _hf_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _run(code, *flags):
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(not _hf_kernels_installed(), reason="HF's kernels distribution is not installed (test extra)")
def test_root_imports_hf_kernels_and_conserve_kernels_side_by_side():
    code = ("import kernels, conserve.kernels as ck; from kernels import CUDAProperties; "
            "print(kernels.__file__); print(ck.__file__); print(ck.evaluate.__module__)")
    res = _run(code)
    assert res.returncode == 0, res.stderr
    theirs, ours, mod = res.stdout.split()
    assert os.path.realpath(ours) == os.path.realpath(OURS)
    # the distribution's copy (a venv may live inside the repository, as CI's does), not the kernels/ folder
    assert not os.path.realpath(theirs).startswith(os.path.dirname(os.path.realpath(OURS)) + os.sep)
    assert mod == "conserve.kernels.dispatch"


@pytest.mark.skipif(not _hf_kernels_installed(), reason="HF's kernels distribution is not installed (test extra)")
def test_in_this_process_the_top_level_kernels_is_the_distribution():
    pytest.importorskip("transformers")
    import kernels
    from conserve import kernels as ck

    assert os.path.realpath(ck.__file__) == os.path.realpath(OURS)
    assert os.path.realpath(kernels.__file__) != os.path.realpath(OURS)
    assert kernels.__spec__.name == "kernels" and hasattr(kernels, "CUDAProperties")


def test_transformers_imports_from_the_repository_root():
    pytest.importorskip("transformers")
    res = _run("from transformers import LlamaConfig, LlamaForCausalLM; print('ok')")
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_without_another_kernels_the_top_level_name_is_missing_and_says_why():
    # -S: no site-packages, so only the repository root offers a ``kernels``
    res = _run("import sys; sys.path.insert(0, ''); import kernels", "-S")
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: No module named 'kernels'") and "conserve.kernels" in last
