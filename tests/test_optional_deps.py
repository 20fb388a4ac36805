"""The engine without its extras: ``LLM.generate`` runs with fastapi, uvicorn, pydantic, prometheus_client, httpx,
matplotlib, xgrammar and ray unimportable (as after a plain ``pip install -e .``), and a feature that needs an
extra names it."""

import subprocess
import sys

import pytest

from kvserve.extras import MissingExtraError, require

#: What a plain install lacks: blocked in the subprocess by a meta-path finder that refuses them.
EXTRAS_ONLY = ("fastapi", "uvicorn", "pydantic", "starlette", "prometheus_client", "httpx", "matplotlib", "xgrammar",
               "ray")

_BLOCK = f"""
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {EXTRAS_ONLY!r}:
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, _Block())
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK + code], capture_output=True, text=True, timeout=600)


@pytest.mark.real_model
def test_generate_runs_without_any_extra():
    proc = _run("""
from kvserve import LLM, SamplingParams
from kvserve.structured import StructuredOutputsParams
llm = LLM(num_kv_blocks=32)
out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))
assert len(out[0].outputs[0].token_ids) == 4
try:
    llm.generate(["x"], SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(choice=["a", "b"])))
except ValueError as e:
    print("STRUCTURED:", e)
print("LOADED:", sorted(m for m in sys.modules if m.split(".")[0] in %r))
""" % (EXTRAS_ONLY,))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED: []" in proc.stdout
    assert "structured_outputs are not available here: structured outputs needs the optional package 'xgrammar': " \
           "pip install 'kvserve[structured]'" in proc.stdout


def test_the_server_command_names_its_extra():
    proc = _run("from kvserve.entrypoints.cli import main\nsys.exit(main(['serve', '--port', '0']))")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "kvserve serve needs the optional package" in proc.stderr and "pip install 'kvserve[server]'" in proc.stderr


def test_require_names_the_extra():
    assert require("json", "server", "x").dumps([]) == "[]"
    with pytest.raises(MissingExtraError, match=r"plots needs the optional package 'no_such_module': "
                                                r"pip install 'kvserve\[bench\]'"):
        require("no_such_module.sub", "bench", "plots")
