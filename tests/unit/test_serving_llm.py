"""vLLM through Ray Serve LLM, checked on the CPU without vLLM (serving/llm.py, cli/serve_vllm.py): the Serve
config is what Ray's own schemas accept (external scaler on, Serve's autoscaling making no decision, the
exported folder as the model source, no accelerator type), the ready serving/vllm.yaml is what the code writes,
the deployment names are the ones Ray Serve LLM 2.60's builder computes (its source read and run here), the
arbiter is registered under those names, and `spotfill serve --engine vllm` without vLLM exits 2 with one
line naming the extra."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import ray
import yaml

from spotfill.config.errors import ConfigError
from spotfill.serving import llm
from spotfill.serving.scaling import keep_external_target

ROOT = pathlib.Path(__file__).resolve().parents[2]
RAY_LLM = pathlib.Path(ray.__file__).parent / "llm" / "_internal" / "serve"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
MODEL_IDS = ["demo", "tiny.llama", "org/Model-1.5B", "a_b/c.d.e", "Qwen2.5-0.5B-Instruct"]


@pytest.fixture
def folder(tmp_path):
    """What `spotfill export` writes, as far as the checks look: config.json and safetensors."""
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (d / "model.safetensors").write_bytes(b"")
    return d


# -- the config -------------------------------------------------------------------------------------------
def test_the_ready_config_is_what_serve_config_writes():
    written = yaml.safe_load((ROOT / "serving" / "vllm.yaml").read_text())
    assert written == llm.serve_config("/home/ubuntu/exports/demo", "demo")


def test_the_serve_config_deploys_ray_serve_llms_app_with_the_external_scaler():
    from ray.serve.schema import ServeDeploySchema
    cfg = llm.serve_config("/models/demo", "demo", port=8123, max_replicas=3)
    schema = ServeDeploySchema.model_validate(cfg)          # Ray's own check of a `serve deploy` config
    (app,) = schema.applications
    assert app.import_path == "ray.serve.llm:build_openai_app"
    assert app.external_scaler_enabled is True
    assert app.deployments == []          # no override the external-scaler check would refuse
    assert schema.http_options.port == 8123 and schema.proxy_location == "HeadOnly"
    ingress = app.args["ingress_deployment_config"]
    assert ingress["num_replicas"] == 1 and "autoscaling_config" not in ingress


def test_the_llm_config_is_ray_serve_llms_own_with_the_folder_and_the_arbiters_count():
    # LLMConfig imports without vLLM (ray.serve.llm does not): Ray's model, the same validation a deploy runs
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    from ray.serve._private.config import DeploymentConfig
    raw = llm.serve_config("/models/tiny.llama", "tiny.llama", max_replicas=2,
                           max_model_len=512)["applications"][0]["args"]["llm_configs"][0]
    cfg = LLMConfig.model_validate(raw)
    assert cfg.model_id == "tiny.llama"
    assert cfg.model_loading_config.model_source == "/models/tiny.llama"
    assert cfg.accelerator_type is None                 # any GPU the arbiter lends
    assert cfg.accelerator_config.kind == "gpu"
    assert cfg.engine_kwargs == {"tensor_parallel_size": 1, "max_model_len": 512}
    assert "num_replicas" not in cfg.deployment_config
    dep = DeploymentConfig(**cfg.deployment_config)
    auto = dep.autoscaling_config
    assert (auto.min_replicas, auto.initial_replicas, auto.max_replicas) == (0, 0, 2)
    assert dep.graceful_shutdown_timeout_s == llm.GRACE_S
    module, _, attr = auto.policy.policy_function.partition(":")
    policy = getattr(importlib.import_module(module), attr)
    assert policy is keep_external_target        # Serve keeps the count the arbiter set
    assert policy(SimpleNamespace(target_num_replicas=1, current_num_replicas=0)) == (1, {})


def test_bad_config_values_are_refused_by_name():
    with pytest.raises(ConfigError, match="--max-replicas"):
        llm.llm_config("/m", "demo", max_replicas=0)
    with pytest.raises(ConfigError, match="--max-model-len"):
        llm.engine_kwargs(0)
    for bad in ("", "a b", "-x", "x#y", "x:y", "é", "a" * 129):
        with pytest.raises(ConfigError, match="model_id"):
            llm.deployment_names(bad)


# -- the names Ray Serve LLM gives its deployments ---------------------------------------------------------
def _ray_function(path: pathlib.Path, name: str):
    """A module-level function of Ray's installed source, compiled alone (its module imports vLLM)."""
    tree = ast.parse(path.read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    fn.returns = None
    for a in fn.args.args:
        a.annotation = None
    ns: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), ns)
    return ns[name]


def test_the_server_deployment_name_is_the_one_ray_serve_llm_builds():
    builder = RAY_LLM / "core" / "server" / "builder.py"
    src = builder.read_text()
    # build_llm_deployment: the class (LLMServer unless a server_cls is set) and its name as the prefix
    assert "deployment_cls = deployment_cls or llm_config.server_cls or LLMServer" in src
    assert 'name_prefix = name_prefix or f"{deployment_cls.__name__}:"' in src
    assert 'deployment_options.get("name", _get_deployment_name(llm_config))' in src
    server_src = ast.parse((RAY_LLM / "core" / "server" / "llm_server.py").read_text())
    assert "LLMServer" in {n.name for n in server_src.body if isinstance(n, ast.ClassDef)}
    ray_name = _ray_function(builder, "_get_deployment_name")
    for model_id in MODEL_IDS:
        assert llm.deployment_names(model_id).server == "LLMServer:" + ray_name(SimpleNamespace(model_id=model_id))
    assert llm.deployment_names("org/Model-1.5B").server == "LLMServer:org--Model-1_5B"


def test_the_ingress_deployment_name_is_the_one_ray_serve_llm_builds():
    src = (RAY_LLM / "core" / "ingress" / "builder.py").read_text()
    assert "default=OpenAiIngress" in src            # IngressClsConfig.ingress_cls
    assert "ingress_cls = make_fastapi_ingress(ingress_cls_config.ingress_cls)" in src
    assert "serve.deployment(ingress_cls, **ingress_options)" in src
    ingress = (RAY_LLM / "core" / "ingress" / "ingress.py").read_text()
    assert "new_cls = type(cls.__name__, (cls,), class_dict)" in ingress   # the class keeps its name
    assert llm.deployment_names("demo").ingress == "OpenAiIngress"


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (the [llm] extra); the names are checked "
                                          "against Ray's source above")
def test_the_names_match_the_application_ray_serve_llm_builds():
    from ray.serve.llm import build_openai_app
    model_id = "org/tiny.llama"
    app = build_openai_app(llm.app_args("/models/x", model_id, max_replicas=1))
    names = {d.name for d in app._build_app_deployments()} if hasattr(app, "_build_app_deployments") else None
    if names is None:
        names = {app._bound_deployment.name} | {a._bound_deployment.name for a in
                                                app._bound_deployment.init_kwargs["llm_deployments"].values()}
    n = llm.deployment_names(model_id)
    assert names == {n.ingress, n.server}


def test_the_arbiter_is_given_the_same_names(monkeypatch):
    import spotfill.fillin.serve_tenant as serve_tenant
    calls = []
    monkeypatch.setattr(serve_tenant, "lend_to_serve_app",
                        lambda app, deployment, **kw: calls.append((app, deployment, kw)) or {"tenant": "t"})
    llm.lend_llm_app("org/tiny.llama", max_replicas=2)
    assert calls == [("spotfill-vllm", "LLMServer:org--tiny_llama", {"max_replicas": 2, "dashboard_url": None})]
    assert llm.deployment_names("org/tiny.llama").tenant == "serve:spotfill-vllm/LLMServer:org--tiny_llama"


# -- the CLI ----------------------------------------------------------------------------------------------
def spotfill(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT)])}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "spotfill", "serve", *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here")
def test_without_vllm_the_cli_exits_2_with_one_line_naming_the_extra(folder):
    res = spotfill("--engine", "vllm", "--model-dir", str(folder), "--port", "1")
    assert res.returncode == 2 and res.stdout == "", (res.returncode, res.stdout, res.stderr)
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("spotfill: error: --engine: vLLM is not installed"), line
    assert "pip install 'spotfill[llm]'" in line and "Traceback" not in res.stderr


@pytest.mark.parametrize("args, flag", [
    ([], "--model-dir"), (["--model-dir", "/nonexistent/x"], "--model-dir"),
    (["--model-dir", "{empty}"], "--model-dir"), (["--model-dir", "{folder}", "--model-id", "a b"], "--model-id"),
    (["--model-dir", "{folder}", "--max-model-len", "0"], "--max-model-len"),
    (["--model-dir", "{folder}", "--max-replicas", "0"], "--max-replicas"),
    (["--model-dir", "{folder}", "--draft", "self:1"], "--draft"),
    (["--model-dir", "{folder}", "--checkpoint", "/tmp"], "--checkpoint"),
    (["--model-dir", "{folder}", "--nodes", "3"], "--nodes")])
def test_bad_input_with_engine_vllm_exits_2_naming_the_flag(folder, tmp_path, args, flag):
    (tmp_path / "empty").mkdir()
    args = [a.format(folder=folder, empty=tmp_path / "empty") for a in args]
    res = spotfill("--engine", "vllm", *args)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith(f"spotfill: error: {flag}:"), res.stderr


def test_engine_vllm_flags_are_refused_with_engine_spotfill(tmp_path):
    res = spotfill("--checkpoint", str(tmp_path), "--model-dir", str(tmp_path))
    assert res.returncode == 2 and res.stderr.startswith("spotfill: error: --model-dir: not used with --engine "
                                                         "spotfill"), res.stderr
    res = spotfill()
    assert res.returncode == 2 and res.stderr.startswith("spotfill: error: --checkpoint: required"), res.stderr


def test_print_config_writes_the_same_deployment_without_vllm(folder):
    res = spotfill("--engine", "vllm", "--model-dir", str(folder), "--max-model-len", "256", "--print-config")
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load(res.stdout) == llm.serve_config(str(folder), "tiny-llama", max_model_len=256)


def test_each_engines_defaults_pass_the_other_engines_refusal():
    """The defaults cli/serve_vllm.py compares against are the parser's own."""
    from spotfill.cli.main import build_parser
    from spotfill.cli.serve_vllm import refuse_flags
    parser = build_parser()
    refuse_flags(parser.parse_args(["serve", "--engine", "vllm", "--model-dir", "/m"]))
    refuse_flags(parser.parse_args(["serve", "--checkpoint", "/runs/x"]))
