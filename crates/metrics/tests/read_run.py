"""Reads back an offline wandb or swanlab run for the tracking tests, with the clients' own record definitions.

usage: python read_run.py wandb|swanlab RUN_ROOT

RUN_ROOT is WANDB_DIR (the run lies in RUN_ROOT/wandb/offline-run-*) or SWANLAB_LOG_DIR (RUN_ROOT/run-*); there
must be exactly one run. Prints one JSON object:
    {"project": str, "name": str, "config": object,
     "history": [{"step": int, "metrics": {key: value as JSON text}}],   # in logged order, client keys dropped
     "tables": [{"step": int, "key": str, "content": object}],          # logged tables, their files' JSON
     "end": str}                                                        # wandb: exit code; swanlab: run state
Values stay JSON text so that NaN and infinities survive the trip. A wandb table's content is
{"columns": [...], "data": [[...]]}; a swanlab table's {"colDefs": [{"field": ...}], "rowData": [{...}]}.
"""

import glob
import json
import os
import struct
import sys


def only(pattern):
    found = glob.glob(pattern)
    if len(found) != 1:
        sys.exit(f"expected one run at {pattern}, found {found}")
    return found[0]


def leveldb_records(path, ident):
    """The records of a wandb/swanlab transaction log: a 7-byte file header, then LevelDB log blocks of 32 KiB
    whose chunks carry a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(ident):
        sys.exit(f"{path}: not a {ident!r} log")
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            break
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def read_wandb(root):
    from wandb.proto import wandb_internal_pb2 as pb

    path = only(f"{root}/wandb/offline-run-*/run-*.wandb")
    files = os.path.join(os.path.dirname(path), "files")
    out = {"project": None, "name": None, "config": {}, "history": [], "tables": [], "end": None}
    for raw in leveldb_records(path, b":W&B"):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["project"], out["name"] = rec.run.project, rec.run.display_name
            for item in rec.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            step = rec.history.step.num
            metrics, nested = {}, {}
            for item in rec.history.item:
                if len(item.nested_key) > 1:
                    # A media value (a table) arrives as one item per field of its summary.
                    parent = "/".join(item.nested_key[:-1])
                    nested.setdefault(parent, {})[item.nested_key[-1]] = item.value_json
                    continue
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    metrics[key] = item.value_json
            for parent, fields in nested.items():
                if json.loads(fields.get("_type", "null")) == "table-file":
                    with open(os.path.join(files, json.loads(fields["path"]))) as f:
                        out["tables"].append({"step": step, "key": parent, "content": json.load(f)})
                elif not parent.startswith("_"):
                    metrics.update({f"{parent}/{k}": v for k, v in fields.items()})
            out["history"].append({"step": step, "metrics": metrics})
        elif kind == "exit":
            out["end"] = str(rec.exit.exit_code)
    out["config"].pop("_wandb", None)
    return out


def read_swanlab(root):
    import yaml
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record

    run_dir = only(f"{root}/run-*")
    path = only(f"{run_dir}/run-*.swanlab")
    out = {"project": None, "name": None, "config": {}, "history": [], "tables": [], "end": None}
    rows = {}
    for raw in leveldb_records(path, b":SWL"):
        rec = Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "start":
            out["project"], out["name"] = rec.start.project, rec.start.name
        elif kind == "scalar":
            rows.setdefault(rec.scalar.step, {})[rec.scalar.key] = json.dumps(rec.scalar.value.number)
        elif kind == "media":
            for item in rec.media.value.items:
                with open(only(f"{run_dir}/media/*/{item.filename}")) as f:
                    out["tables"].append({"step": rec.media.step, "key": rec.media.key, "content": json.load(f)})
        elif kind == "finish":
            states = rec.finish.DESCRIPTOR.fields_by_name["state"].enum_type
            out["end"] = states.values_by_number[rec.finish.state].name
    out["history"] = [{"step": s, "metrics": m} for s, m in sorted(rows.items())]
    with open(f"{run_dir}/files/config.yaml") as f:
        out["config"] = {k: v["value"] for k, v in (yaml.safe_load(f) or {}).items()}
    return out


if __name__ == "__main__":
    reader = {"wandb": read_wandb, "swanlab": read_swanlab}[sys.argv[1]]
    print(json.dumps(reader(sys.argv[2])))
