"""What the CLI's error tests share: the arguments of a run, the in-process and the real entry point, and the
check of a user error: one line "fastppl: error: ...", exit code 2, no traceback, no output file created."""
import os
import subprocess
import sys
from pathlib import Path

from fastppl.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = "random:gpt2-tiny"


def _copy_checkpoint(source: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in source.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def _args(model, data, outputs, tokenizer_dir, *extra):
    json_path, npy_path = outputs
    return ["eval", "--model", str(model), "--data", str(data), "--tokenizer", str(tokenizer_dir), "--device", "cpu",
            "--quiet", "--json", str(json_path), "--per-token", str(npy_path), *map(str, extra)]


def _assert_user_error(rc, err, outputs, *fragments):
    assert rc == 2, err
    assert err.startswith("fastppl: error: ") and err.count("\n") == 1, err   # exactly one line
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    for path in outputs:
        assert not path.exists(), f"{path} was created"
    leftovers = list(outputs[0].parent.iterdir()) if outputs[0].parent.is_dir() else []
    assert leftovers == [], f"partial files left: {leftovers}"


def _main(capsys, args):
    rc = main(args)
    return rc, capsys.readouterr().err


def _subprocess(args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "fastppl", *args], capture_output=True, text=True, env=env,
                          timeout=120)

