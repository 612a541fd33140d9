"""verl-rs tracking sidecar: one Python tracking client (wandb, mlflow or swanlab) driven by the Rust host.

The host embeds this file and runs it with the interpreter of `VERL_PYTHON` (else `python3`), the logger name
as the only argument. Python never runs inside the host: this process is the only place the clients live.

Protocol, one JSON object per line. The host writes requests on stdin; every request gets one answer on the
protocol stream (the process's original stdout; whatever the clients print goes to stderr instead):

    {"op": "init", "project": str, "experiment": str, "config": object|null}
        -> {"ok": "ready", "detail": str}               the run exists
    {"op": "check"}                                      (instead of init: imports + reachability, no run)
        -> {"ok": "checked", "detail": str}
    {"op": "log", "step": int, "metrics": {str: number}}   (NaN/Infinity as Python's json writes them)
        -> {"ok": "logged", "step": int}
    {"op": "generations", "step": int, "samples": [{"input": str, "output": str, "score": number}]}
        -> {"ok": "logged", "step": int}                 (verl's ValidationGenerationsLogger, per client)
    {"op": "finish", "exit_code": int}
        -> {"ok": "finished"}, then the process exits

A failed request answers {"error": str, "kind": "import"|"check"|"init"|"log"|"finish"|"protocol", "op": str}
(plus "step" for a log or generations); after a failed import, check, init or finish the process exits. End of input without
a finish (the host died) finishes the run with exit code 1.
"""

import json
import os
import signal
import sys
import tempfile
import traceback

# `python -c` puts the working directory first on sys.path: a stray `wandb.py` there must not shadow the client.
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

# Retries of MLflow's HTTP client while a run starts: its defaults (7 retries, exponential backoff) take minutes
# to report an unreachable server; the user's own settings win.
MLFLOW_START_HTTP = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}
# verl retries a failed `mlflow.log_metrics` this many times, without sleeping (it runs every step).
MLFLOW_LOG_ATTEMPTS = 3
# Where every client shows the validation samples (`trainer.log_val_generations`).
GENERATIONS_KEY = "val/generations"


def one_line(error):
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= 2000 else text[:2000] + " ..."


class StartHttpLimits:
    """Applies MLFLOW_START_HTTP for the duration of a `with` block."""

    def __enter__(self):
        self.added = [k for k in MLFLOW_START_HTTP if k not in os.environ]
        for k in self.added:
            os.environ[k] = MLFLOW_START_HTTP[k]

    def __exit__(self, *exc):
        for k in self.added:
            os.environ.pop(k, None)


class Wandb:
    package = "wandb"

    def __init__(self):
        import wandb

        self.wandb = wandb
        self.run = None
        # One row per validation so far: the table is logged whole each time (a logged wandb.Table cannot grow).
        self.generation_rows = []

    def mode(self):
        return os.environ.get("WANDB_MODE", "online")

    def check(self):
        detail = f"wandb {self.wandb.__version__}, mode {self.mode()}"
        if self.mode() in ("offline", "disabled", "dryrun"):
            return detail
        try:
            from wandb.sdk.lib import wbauth
        except ImportError:
            return detail + " (credentials not checked: this wandb has no wbauth)"
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
        auth = wbauth.authenticate_session(host=host, source="verl --dry-run", prompt=False, update_session=False)
        if auth is None:
            raise RuntimeError(
                f"no W&B API key for {host} (WANDB_API_KEY or `wandb login`); or set WANDB_MODE=offline"
            )
        return detail + f", credentials for {host} found"

    def start(self, project, experiment, config):
        # verl: `trainer.wandb_proxy` becomes the https proxy of the run.
        proxy = ((config or {}).get("trainer") or {}).get("wandb_proxy")
        settings = self.wandb.Settings(https_proxy=proxy) if proxy else None
        self.run = self.wandb.init(
            project=project,
            name=experiment,
            entity=os.environ.get("WANDB_ENTITY"),
            config=config,
            settings=settings,
        )
        return f"wandb {self.wandb.__version__}: run {self.run.id} ({self.mode()}) in {self.run.dir}"

    def log(self, step, metrics):
        self.run.log(metrics, step=step)

    def log_generations(self, step, samples):
        # verl's columns: step, then input_i, output_i, score_i for each sample i from 1.
        columns = ["step"]
        for i in range(1, len(samples) + 1):
            columns += [f"input_{i}", f"output_{i}", f"score_{i}"]
        row = [step]
        for sample in samples:
            row.extend(sample)
        # Raises, keeping the earlier rows, if this validation has another number of samples than the first.
        table = self.wandb.Table(columns=columns, data=self.generation_rows)
        table.add_data(*row)
        self.run.log({GENERATIONS_KEY: table}, step=step)
        self.generation_rows.append(row)

    def finish(self, exit_code):
        # Waits until wandb's service has written (and, online, uploaded) everything.
        run, self.run = self.run, None
        if run is not None:
            run.finish(exit_code=exit_code)


class Mlflow:
    package = "mlflow"

    def __init__(self):
        import re

        import mlflow

        self.mlflow = mlflow
        self.active = False
        # MLflow accepts alphanumerics, `_ . - : /` and spaces in metric names; verl maps `@` to `_at_`, squeezes
        # repeated slashes and turns anything else into `_`.
        self.invalid = re.compile(r"[^/\w.\- :]")
        self.slashes = re.compile(r"/+")
        self.keys = {}

    def uri(self):
        return os.environ.get("MLFLOW_TRACKING_URI", "sqlite:////tmp/mlruns.db")

    def check(self):
        uri = self.uri()
        path = local_store_path(uri)
        if path is not None:
            # A local store is created on first use; a dry run must not create it.
            parent = os.path.dirname(os.path.abspath(path)) or "."
            if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
                raise RuntimeError(f"tracking URI {uri}: folder {parent} does not exist or is not writable")
            return f"mlflow {self.mlflow.__version__}, local store {uri}"
        from mlflow.tracking import MlflowClient

        with StartHttpLimits():
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        return f"mlflow {self.mlflow.__version__}, tracking server {uri} answers"

    def start(self, project, experiment, config):
        uri = self.uri()
        self.mlflow.set_tracking_uri(uri)
        with StartHttpLimits():
            # Azure ML, Databricks and others set MLFLOW_RUN_ID: log into that run.
            run_id = os.environ.get("MLFLOW_RUN_ID")
            if run_id:
                run = self.mlflow.start_run(run_id=run_id)
            else:
                exp = self.mlflow.set_experiment(project)
                run = self.mlflow.start_run(experiment_id=exp.experiment_id, run_name=experiment)
            self.active = True
            self.mlflow.log_params(mlflow_params(config))
        return f"mlflow {self.mlflow.__version__}: run {run.info.run_id} at {uri}"

    def key(self, name):
        if name not in self.keys:
            clean = self.invalid.sub("_", self.slashes.sub("/", name.replace("@", "_at_")))
            if clean != name:
                print(f"[mlflow] metric `{name}` is logged as `{clean}` (MLflow does not accept its characters)",
                      file=sys.stderr)
            self.keys[name] = clean
        return self.keys[name]

    def log(self, step, metrics):
        named = {self.key(k): v for k, v in metrics.items()}
        for attempt in range(1, MLFLOW_LOG_ATTEMPTS + 1):
            try:
                self.mlflow.log_metrics(named, step=step)
                return
            except Exception as e:
                if attempt == MLFLOW_LOG_ATTEMPTS:
                    raise
                print(f"[mlflow] log_metrics step {step} attempt {attempt} failed: {one_line(e)}", file=sys.stderr)

    def log_generations(self, step, samples):
        # verl: one JSON file per validation, `val_step<step>.json` at the root of the run's artifacts; a failure
        # is only a warning, as there.
        rows = [{"input": i, "output": o, "score": s} for i, o, s in samples]
        try:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, f"val_step{step}.json")
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(rows, f)
                self.mlflow.log_artifact(path)
        except Exception as e:
            print(f"WARNING: [mlflow] the validation samples of step {step} were not saved: {one_line(e)}",
                  file=sys.stderr)

    def finish(self, exit_code):
        if self.active:
            self.active = False
            self.mlflow.end_run(status="FINISHED" if exit_code == 0 else "FAILED")


def local_store_path(uri):
    """The file or folder of a local MLflow store (`sqlite:///`, `file:`, a plain path), else None."""
    if uri.startswith("sqlite:///"):
        return uri[len("sqlite:///"):]
    if uri.startswith("file://"):
        return uri[len("file://"):]
    if "://" not in uri and not uri.startswith("databricks"):
        return uri
    return None


def mlflow_params(config):
    """verl's MLflow params: lists become {"list_len": n, "0": ..}, then nested keys join with `/`; empty
    mappings vanish (as in pandas.json_normalize, which verl uses)."""
    flat = {}

    def walk(prefix, value):
        if isinstance(value, list):
            value = {"list_len": len(value), **{str(i): v for i, v in enumerate(value)}}
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v)
        else:
            flat[prefix] = value

    if config is not None:
        walk("", config)
    return flat


class Swanlab:
    package = "swanlab"

    def __init__(self):
        import swanlab

        self.swanlab = swanlab
        self.active = False

    def mode(self):
        return os.environ.get("SWANLAB_MODE", "cloud")

    def check(self):
        detail = f"swanlab {self.swanlab.__version__}, mode {self.mode()}"
        if self.mode() != "cloud":
            return detail
        # Where swanlab itself looks: SWANLAB_API_KEY, then the .netrc `swanlab login` writes in the
        # working directory's .swanlab or in SWANLAB_ROOT (SWANLAB_SAVE_DIR, ~/.swanlab).
        if os.environ.get("SWANLAB_API_KEY"):
            return detail + ", API key from SWANLAB_API_KEY"
        import netrc
        from pathlib import Path

        root = os.environ.get("SWANLAB_ROOT") or os.environ.get("SWANLAB_SAVE_DIR") or str(Path.home() / ".swanlab")
        for folder in (Path.cwd() / ".swanlab", Path(root)):
            path = folder / ".netrc"
            try:
                hosts = netrc.netrc(str(path)).hosts
            except (FileNotFoundError, IsADirectoryError):
                continue
            except (netrc.NetrcParseError, PermissionError) as e:
                raise RuntimeError(f"cannot read SwanLab credentials at {path}: {e}")
            if any(password for (_, _, password) in hosts.values()):
                return detail + f", credentials in {path}"
        raise RuntimeError(
            "no SwanLab API key (SWANLAB_API_KEY or `swanlab login`); or set SWANLAB_MODE=offline or local"
        )

    def start(self, project, experiment, config):
        key = os.environ.get("SWANLAB_API_KEY")
        if key:
            self.swanlab.login(key)
        log_dir = os.environ.get("SWANLAB_LOG_DIR", "swanlog")
        self.swanlab.init(
            project=project,
            experiment_name=experiment,
            config={"FRAMEWORK": "verl", **(config or {})},
            logdir=log_dir,
            mode=self.mode(),
        )
        self.active = True
        return f"swanlab {self.swanlab.__version__}: {self.mode()} run, logs in {log_dir}"

    def log(self, step, metrics):
        self.swanlab.log(metrics, step=step)

    def log_generations(self, step, samples):
        # verl: a table of this validation alone, one sample per row.
        table = self.swanlab.echarts.Table()
        table.add(headers=["step", "input", "output", "score"], rows=[[step, *sample] for sample in samples])
        self.swanlab.log({GENERATIONS_KEY: table}, step=step)

    def finish(self, exit_code):
        if self.active:
            self.active = False
            if exit_code == 0:
                self.swanlab.finish()
            else:
                self.swanlab.finish(state="crashed", error=f"the verl-rs trainer stopped (exit code {exit_code})")


BACKENDS = {"wandb": Wandb, "mlflow": Mlflow, "swanlab": Swanlab}


def main():
    logger = sys.argv[1]
    # The protocol moves to private copies of stdin/stdout, which child processes do not inherit: fd 1 becomes
    # stderr, so that prints of the clients (and of the processes they start) cannot corrupt the replies, and
    # fd 0 becomes /dev/null, so that a client looking for a login prompt reads nothing of the requests.
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    sys.stdin = open(os.devnull, encoding="utf-8")
    sys.stdout = sys.stderr
    # The host decides when the run ends; Ctrl-C in its terminal must not kill the run half-written.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def reply(**msg):
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    def fail(kind, op, error, **extra):
        traceback.print_exc(file=sys.stderr)
        reply(error=one_line(error), kind=kind, op=op, **extra)

    line = requests.readline()
    if not line:
        return 0
    first = json.loads(line)
    try:
        backend = BACKENDS[logger]()
    except Exception as e:
        fail("import", f"import {BACKENDS[logger].package}", e)
        return 1

    if first.get("op") == "check":
        try:
            reply(ok="checked", detail=backend.check())
            return 0
        except Exception as e:
            fail("check", f"{logger} check", e)
            return 1
    if first.get("op") != "init":
        reply(error=f"expected an init or check request first, got {line.strip()[:200]}", kind="protocol",
              op="start")
        return 1
    try:
        detail = backend.start(first["project"], first["experiment"], first.get("config"))
    except Exception as e:
        fail("init", f"{logger} init", e)
        try:
            backend.finish(1)
        except Exception:
            traceback.print_exc(file=sys.stderr)
        return 1
    reply(ok="ready", detail=detail)

    for line in requests:
        msg = json.loads(line)
        op = msg.get("op")
        if op == "log":
            try:
                backend.log(msg["step"], msg["metrics"])
                reply(ok="logged", step=msg["step"])
            except Exception as e:
                fail("log", f"{logger} log", e, step=msg["step"])
        elif op == "generations":
            try:
                samples = [(s["input"], s["output"], s["score"]) for s in msg["samples"]]
                backend.log_generations(msg["step"], samples)
                reply(ok="logged", step=msg["step"])
            except Exception as e:
                fail("log", f"{logger} validation generations", e, step=msg["step"])
        elif op == "finish":
            try:
                backend.finish(int(msg.get("exit_code", 0)))
                reply(ok="finished")
                return 0
            except Exception as e:
                fail("finish", f"{logger} finish", e)
                return 1
        else:
            reply(error=f"unknown request {line.strip()[:200]}", kind="protocol", op=str(op))
    print(f"[{logger}] the host closed the pipe without a finish; ending the run as failed", file=sys.stderr)
    backend.finish(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
