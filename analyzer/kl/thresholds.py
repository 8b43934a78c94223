"""KL thresholds per (model, tp), in a JSON file users commit next to their tests.

    {
      "format": "dumpdiff-kl-thresholds",
      "version": 1,
      "entries": {
        "meta-llama/Llama-3.1-8B-Instruct tp=1": {
          "model": "meta-llama/Llama-3.1-8B-Instruct", "tp": 1,
          "kl_div": 0.002,                              <- avg_kl_div above this is dirty
          "helpers": {"decode_cache_hit": 0.004},        <- optional per-helper overrides
          "calibration": {...}                           <- what `dumpdiff kl calibrate` saw
        }
      }
    }

An entry is found by the server's model_path, then its served_model_name, then (when exactly
one entry matches) the last component of the path, so an entry keyed by a hub name also
matches the same model served from a local folder of that name.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Optional

from ..errors import DumpError

DEFAULT_FILE = "dumpdiff-kl-thresholds.json"
FORMAT = "dumpdiff-kl-thresholds"
# Used when no entry matches: sglang's KL tests use thresholds of this order for bf16 models
# on GPU. Calibrate for your engine; a float32 CPU engine needs a far smaller one.
DEFAULT_THRESHOLD = 1e-3
# When every token was bit-identical, a threshold of 0 would fail on one stray ulp.
ULP_FLOOR = 1e-9
DEFAULT_MARGIN = 10.0


def key_of(model: str, tp: int) -> str:
    return f"{model} tp={int(tp)}"


def load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return {"format": FORMAT, "version": 1, "entries": {}}
    except ValueError as exc:  # a JSONL file, a binary file: json's own words say where
        raise DumpError(
            f"{path}: not one JSON document ({exc}); a thresholds file is the JSON `dumpdiff kl "
            "calibrate` writes: fix or delete it"
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        raise DumpError(
            f'{path}: not a {FORMAT} file (expected {{"format": "{FORMAT}", "entries": {{...}}}}, '
            "as `dumpdiff kl calibrate` writes)"
        )
    for key, entry in data["entries"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("kl_div"), (int, float)) or entry["kl_div"] < 0:
            raise DumpError(f"{path}: entry {key!r} needs a non-negative number kl_div")
        try:
            int(entry.get("tp", 1))  # as find() reads it
        except (TypeError, ValueError):
            raise DumpError(f"{path}: entry {key!r} needs a whole number tp (the tensor-parallel size)") from None
    return data


def save(path: str, data: dict) -> None:
    """Atomic write, sorted keys: a file that diffs well in review."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.replace(tmp, path)


def find(data: dict, model: str, tp: int, served_name: Optional[str] = None):
    """(key, entry) for this model and tp, or (None, None)."""
    entries = data["entries"]
    same_tp = {k: e for k, e in entries.items() if int(e.get("tp", 1)) == int(tp)}
    for name in (model, served_name):
        if not name:
            continue
        for key, entry in same_tp.items():
            if entry.get("model") == name:
                return key, entry
    base = os.path.basename(str(model).rstrip("/"))
    by_base = [(k, e) for k, e in same_tp.items() if os.path.basename(str(e.get("model", "")).rstrip("/")) == base]
    if base and len(by_base) == 1:
        return by_base[0]
    return None, None


def resolve_thresholds(threshold: Optional[float], path: Optional[str], target: dict) -> dict:
    """The threshold in force: --threshold, else the file's entry, else the default."""
    if threshold is not None:
        return {"value": float(threshold), "helpers": {}, "source": "--threshold", "key": None}
    path = path or DEFAULT_FILE
    if os.path.exists(path):
        data = load(path)
        key, entry = find(data, target.get("model"), target.get("tp", 1), target.get("served_model_name"))
        if entry is not None:
            found = {
                "value": float(entry["kl_div"]),
                "helpers": {k: float(v) for k, v in (entry.get("helpers") or {}).items()},
                "source": path,
                "key": key,
            }
            calibrated = (
                (entry.get("calibration") or {}).get("dtype") if isinstance(entry.get("calibration"), dict) else None
            )
            if calibrated and target.get("dtype") and str(calibrated) != str(target["dtype"]):
                # a float32 threshold fails every bfloat16 run; a bfloat16 one hides float32 bugs
                found["note"] = (
                    f"{key} in {path} was calibrated on a {calibrated} server, this one runs "
                    f"{target['dtype']}: rerun `dumpdiff kl calibrate` on this server"
                )
            return found
        where = f"no entry for {key_of(target.get('model'), target.get('tp', 1))} in {path}"
    else:
        where = f"no thresholds file {path}"
    return {
        "value": DEFAULT_THRESHOLD,
        "helpers": {},
        "source": "default",
        "key": None,
        "note": f"{where}: using the default {DEFAULT_THRESHOLD:g}; run `dumpdiff kl calibrate` to set one",
    }


def propose(runs: list, margin: float = DEFAULT_MARGIN, floor: float = ULP_FLOOR) -> dict:
    """A threshold from repeated runs of a known-good engine.

    - every token of every run bit-identical: the stray-ulp floor (1e-9), so that one stray
      ulp later does not fail the check;
    - otherwise margin x the largest avg_kl_div seen, and at least the largest per-token k3
      seen (the average cannot pass that unless tokens get worse than the worst one seen).
      No floor here: on a float32 engine the noise is ~1e-13 and a floor of 1e-9 would hide
      real bugs four orders of magnitude above it.
    """
    observed, maxima, tokens, identical = {}, {}, 0, 0
    for run in runs:
        for name, h in run["helpers"].items():
            if h["status"] not in ("clean", "dirty"):
                continue
            observed[name] = max(observed.get(name, 0.0), h["avg_kl_div"])
            maxima[name] = max(maxima.get(name, 0.0), h["max_kl"])
            tokens += h["tokens"]
            identical += h["bit_identical"]
    if not observed:
        raise DumpError("no helper produced scores to calibrate on")
    worst = max(observed.values())
    bit_exact = tokens > 0 and identical == tokens
    worst_token = max(maxima.values())
    value = floor if bit_exact or worst == 0 else max(margin * worst, worst_token)
    return {
        "kl_div": float(value),
        "observed_avg_kl_div": observed,
        "observed_max_kl": maxima,
        "max_observed": worst,
        "bit_exact": bit_exact,
        "tokens": tokens,
        "bit_identical": identical,
        "margin": margin,
        "floor": floor,
        "rule": "ulp floor (every token bit-identical)"
        if bit_exact
        else f"max({margin:g} x largest avg_kl_div seen, largest per-token k3 seen)",
    }


def update(path: str, target: dict, proposal: dict, extra: dict) -> str:
    """Write (or replace) the entry for the target's model and tp; returns its key."""
    data = load(path)
    key, old = find(data, target["model"], target["tp"], target.get("served_model_name"))
    if key is None:
        key = key_of(target["model"], target["tp"])
    entry = dict(old or {})
    entry.update(
        {"model": (old or {}).get("model", target["model"]), "tp": int(target["tp"]), "kl_div": proposal["kl_div"]}
    )
    entry["calibration"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "dtype": target.get("dtype"),
        "engine": target.get("engine"),
        "engine_version": target.get("version"),
        "observed_avg_kl_div": proposal["observed_avg_kl_div"],
        "observed_max_kl": proposal["observed_max_kl"],
        "bit_exact": proposal["bit_exact"],
        "tokens": proposal["tokens"],
        "bit_identical": proposal["bit_identical"],
        "rule": proposal["rule"],
        **extra,
    }
    data["entries"][key] = entry
    save(path, data)
    return key
