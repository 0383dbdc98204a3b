"""vLLM on GPUs: Ray Serve LLM's OpenAI app (`ray.serve.llm.build_openai_app`) over an exported Hugging Face
folder (`spotfill export RUN --out DIR`), deployed with `external_scaler_enabled` so the fill-in arbiter lends
and reclaims its GPUs like spotfill's own app. Used by `spotfill serve --engine vllm`, `serving/vllm.yaml`
(written by serve_config) and the GPU check. Needs the `[llm]` extra (`pip install 'spotfill[llm]'`: the vLLM
that Ray 2.60's `ray[llm]` pins); nothing here imports Ray Serve LLM or vLLM until a deploy.

Names (Ray 2.60, read from its source): the server deployment is `LLMServer:<model_id>` with `/` -> `--`
and `.` -> `_` in the model id (ray/llm/_internal/serve/core/server/builder.py: `_get_deployment_name`, and
`name_prefix = f"{deployment_cls.__name__}:"` in `build_llm_deployment`); the ingress deployment is
`OpenAiIngress` (ray/llm/_internal/serve/core/ingress/builder.py `build_openai_app`, whose
`make_fastapi_ingress` keeps the class name). deployment_names() is the one place both the config and the
arbiter's registration take them from. Ray Serve LLM's direct-streaming mode
(RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1) builds another graph and is not what this deploys."""
from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass

from spotfill.config.errors import ConfigError
from spotfill.serving.scaling import POLICY_PATH

EXTRA = "pip install 'spotfill[llm]'"
APP_NAME = "spotfill-vllm"
IMPORT_PATH = "ray.serve.llm:build_openai_app"
INGRESS_DEPLOYMENT = "OpenAiIngress"
SERVER_CLASS = "LLMServer"
GRACE_S = 5.0                 # graceful_shutdown_timeout_s: a reclaim waits at most this for requests in flight
DEFAULT_MAX_REPLICAS = 4      # the written config's max_replicas (the CLI uses the cluster's GPUs)
MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
MODEL_ID_ACCEPTED = "1-128 of A-Z a-z 0-9 . _ - / starting with a letter or digit"
WEIGHTS = (".safetensors", ".bin")


@dataclass(frozen=True)
class Names:
    app: str
    ingress: str          # OpenAiIngress: routes /v1/... to the server deployment
    server: str           # LLMServer:<model id, sanitized>: the vLLM engine, one GPU per replica

    @property
    def tenant(self) -> str:
        """The arbiter's name for the lent deployment (fillin/serve_tenant.py ServeTenantSpec.tenant)."""
        return f"serve:{self.app}/{self.server}"


def check_model_id(model_id: str, field: str = "--model-id") -> str:
    if not isinstance(model_id, str) or not MODEL_ID.fullmatch(model_id):
        raise ConfigError(field, model_id, accepted=MODEL_ID_ACCEPTED)
    return model_id


def deployment_names(model_id: str, app: str = APP_NAME) -> Names:
    """The deployment names Ray Serve LLM 2.60 gives build_openai_app's graph for one model."""
    check_model_id(model_id, "model_id")
    return Names(app, INGRESS_DEPLOYMENT, f"{SERVER_CLASS}:" + model_id.replace("/", "--").replace(".", "_"))


def default_model_id(model_dir: str) -> str:
    """The folder's own name (what clients put in `model`), checked as --model-id."""
    return check_model_id(os.path.basename(os.path.normpath(model_dir)), "--model-id")


def check_model_dir(model_dir: str, field: str = "--model-dir") -> str:
    """The exported folder as an absolute path: a directory with config.json and weights (what `spotfill
    export` writes and vLLM loads)."""
    if not model_dir:
        raise ConfigError(field, reason="required with --engine vllm", accepted="a folder `spotfill export` wrote")
    path = os.path.abspath(os.path.expanduser(model_dir))
    if not os.path.isdir(path):
        raise ConfigError(field, model_dir, reason="no such folder", accepted="a folder `spotfill export` wrote")
    names = os.listdir(path)
    if "config.json" not in names or not any(n.endswith(WEIGHTS) for n in names):
        raise ConfigError(field, model_dir, reason="not a Hugging Face model folder (config.json and "
                          "*.safetensors needed)", accepted="a folder `spotfill export RUN --out DIR` wrote")
    return path


def engine_kwargs(max_model_len: int | None = None) -> dict:
    """vLLM's engine arguments: one GPU per replica (the arbiter lends whole GPUs), the context capped when
    asked (the KV cache then fits smaller GPUs)."""
    kwargs: dict = {"tensor_parallel_size": 1}
    if max_model_len is not None:
        if int(max_model_len) < 1:
            raise ConfigError("--max-model-len", max_model_len, accepted="an integer >= 1 (tokens)")
        kwargs["max_model_len"] = int(max_model_len)
    return kwargs


def llm_config(model_dir: str, model_id: str, *, max_replicas: int, max_model_len: int | None = None,
               grace_s: float = GRACE_S) -> dict:
    """Ray Serve LLM's LLMConfig (as a dict) for the exported folder. accelerator_type is left unset (any
    GPU the arbiter lends). Serve refuses num_replicas 0, so the deployment has an autoscaling range 0..max
    that starts at 0 with spotfill's keep_external_target policy: Serve makes no decision of its own, the
    arbiter's scale calls set the count (like spotfill's Generator, serving/app.py)."""
    check_model_id(model_id)
    if int(max_replicas) < 1:
        raise ConfigError("--max-replicas", max_replicas, accepted="an integer >= 1")
    return {
        "model_loading_config": {"model_id": model_id, "model_source": model_dir},
        "engine_kwargs": engine_kwargs(max_model_len),
        "deployment_config": {
            "autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": int(max_replicas),
                                   "policy": {"policy_function": POLICY_PATH}},
            "graceful_shutdown_wait_loop_s": 0.1, "graceful_shutdown_timeout_s": float(grace_s)},
    }


def app_args(model_dir: str, model_id: str, **kwargs) -> dict:
    """build_openai_app's argument (LLMServingArgs as a dict): the model, and one ingress replica on the head
    (on-demand; no GPU, no Serve autoscaling: num_replicas drops Ray Serve LLM's default autoscaling)."""
    return {"llm_configs": [llm_config(model_dir, model_id, **kwargs)],
            "ingress_deployment_config": {"num_replicas": 1, "ray_actor_options": {
                "num_cpus": 0, "resources": {"node:__internal_head__": 0.001}}}}


def serve_config(model_dir: str, model_id: str, *, app: str = APP_NAME, port: int = 8000,
                 max_replicas: int = DEFAULT_MAX_REPLICAS, max_model_len: int | None = None) -> dict:
    """The `serve deploy` config: Ray Serve LLM's OpenAI app over `model_dir` with the external scaler on,
    Serve's controller set up for fill-in as for spotfill's own app (serving/deploy.py)."""
    from spotfill.serving.deploy import serve_controller_env
    return {
        "controller_options": {"runtime_env": {"env_vars": serve_controller_env("GPU")}},
        "proxy_location": "HeadOnly",
        "http_options": {"host": "0.0.0.0", "port": int(port)},
        "applications": [{
            "name": app, "route_prefix": "/", "import_path": IMPORT_PATH, "external_scaler_enabled": True,
            "args": app_args(model_dir, model_id, max_replicas=max_replicas, max_model_len=max_model_len)}],
    }


def vllm_missing() -> str | None:
    """Why vLLM cannot run here (None: it can): the package is absent."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed here (it runs on GPU machines only)"
    return None


def require_vllm(field: str = "--engine") -> None:
    missing = vllm_missing()
    if missing:
        raise ConfigError(field, "vllm", reason=missing, accepted=f"{EXTRA} on a GPU machine, or --engine spotfill")


def lend_llm_app(model_id: str, *, max_replicas: int, app: str = APP_NAME, dashboard_url: str | None = None) -> dict:
    """Register a deployed Ray Serve LLM app (serving/vllm.yaml, or deploy_llm) with the arbiter by its
    model id: its LLMServer deployment becomes a fill-in tenant (fillin/serve_tenant.lend_to_serve_app)."""
    from spotfill.fillin.serve_tenant import lend_to_serve_app
    return lend_to_serve_app(app, deployment_names(model_id, app).server, max_replicas=max_replicas,
                             dashboard_url=dashboard_url)


def deploy_llm(model_dir: str, model_id: str, *, port: int, max_replicas: int, max_model_len: int | None = None,
               app: str = APP_NAME, dashboard_url: str | None = None) -> dict:
    """Deploy Ray Serve LLM's OpenAI app on the connected cluster (HTTP on 127.0.0.1:`port`) with the
    external scaler on and register it with the arbiter (started if absent): replicas run only on GPUs the
    arbiter lends. Returns {"url", "names", "tenant"}."""
    require_vllm()
    from ray import serve
    from ray.serve.llm import build_openai_app

    from spotfill.serving.deploy import start_serve
    args = app_args(model_dir, model_id, max_replicas=max_replicas, max_model_len=max_model_len)
    start_serve(port, "GPU")
    serve.run(build_openai_app(args), name=app, route_prefix="/", blocking=False, external_scaler_enabled=True)
    names = deployment_names(model_id, app)
    answer = lend_llm_app(model_id, max_replicas=max_replicas, app=app, dashboard_url=dashboard_url)
    return {"url": f"http://127.0.0.1:{port}", "names": names, "tenant": answer.get("tenant", names.tenant)}
