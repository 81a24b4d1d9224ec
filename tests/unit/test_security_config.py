"""TLS / token / Redis security settings: validation, error messages, and that no secret leaks into them."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest
from redis.asyncio.connection import SSLConnection

from llmserve.cli import build_parser, main
from llmserve import security_flags as sec
from shared.redis_client import RedisOptions, connect
from shared.secrets import read_secret_file, redact_url, resolve_secret
from shared.tls import ClientTLS, ServerTLS, client_tls, server_tls
from tests.certs import make_ca

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cr3t-token-value-9f2c"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - (CA, server files, client files)
    ca = make_ca(tmp_path_factory.mktemp("pki"), "unit")
    return ca, ca.issue("server"), ca.issue("client", client=True)


# --- TLS configs ------------------------------------------------------------------------------------------


def test_server_tls_loads_pem_and_never_shows_the_key(pki) -> None:
    ca, server, _ = pki
    tls = ServerTLS(str(server.cert), str(server.key), str(ca.cert))
    assert tls.mutual
    assert "PRIVATE KEY" not in repr(tls) and "BEGIN" not in repr(tls)
    assert server_tls("", "", "") is None
    assert not server_tls(str(server.cert), str(server.key)).mutual  # type: ignore[union-attr]


def test_missing_file_names_the_flag_and_the_path(tmp_path: Path, pki) -> None:
    _, server, _ = pki
    missing = tmp_path / "nope.crt"
    with pytest.raises(ValueError, match=r"--tls-cert-file: cannot read certificate file '.*nope\.crt'"):
        ServerTLS(str(missing), str(server.key))
    with pytest.raises(ValueError, match=r"--worker-tls-ca-file: cannot read CA certificate file"):
        client_tls(str(missing), flag_prefix="worker-tls")


def test_a_non_pem_file_is_refused_without_echoing_it(tmp_path: Path, pki) -> None:
    _, server, _ = pki
    bogus = tmp_path / "key.txt"
    bogus.write_text(SECRET)
    with pytest.raises(ValueError, match=r"--tls-key-file: '.*key\.txt' is not a PEM file") as info:
        ServerTLS(str(server.cert), str(bogus))
    assert SECRET not in str(info.value)


def test_cert_and_key_go_together(pki) -> None:
    ca, server, client = pki
    with pytest.raises(ValueError, match=r"--tls-cert-file and --tls-key-file go together"):
        server_tls("", "", str(ca.cert))  # a client CA alone: the server would not speak TLS
    with pytest.raises(ValueError, match=r"--worker-tls-cert-file and --worker-tls-key-file go together.*key_file=''"):
        ClientTLS(str(ca.cert), str(client.cert), "", flag_prefix="worker-tls")
    assert client_tls() is None


# --- secrets ----------------------------------------------------------------------------------------------


def test_secret_from_file_or_environment(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(SECRET + "\n")
    assert resolve_secret(str(path), "--auth-token-file", "LLMSERVE_AUTH_TOKEN", {}) == SECRET
    assert resolve_secret("", "--auth-token-file", "LLMSERVE_AUTH_TOKEN", {"LLMSERVE_AUTH_TOKEN": SECRET}) == SECRET
    assert resolve_secret("", "--auth-token-file", "LLMSERVE_AUTH_TOKEN", {}) == ""
    with pytest.raises(ValueError, match="--auth-token-file and the environment variable LLMSERVE_AUTH_TOKEN are both "
                                         "set") as info:
        resolve_secret(str(path), "--auth-token-file", "LLMSERVE_AUTH_TOKEN", {"LLMSERVE_AUTH_TOKEN": "other"})
    assert SECRET not in str(info.value)


def test_bad_secret_files_are_named(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"--redis-password-file: '.*empty' is empty"):
        read_secret_file(str(empty), "--redis-password-file")
    with pytest.raises(ValueError, match=r"--auth-token-file: cannot read '.*absent'"):
        read_secret_file(str(tmp_path / "absent"), "--auth-token-file")


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:hunter2@redis:6379/0", "redis://:***@redis:6379/0"),
    ("rediss://app:hunter2@redis.example:6380/1", "rediss://app:***@redis.example:6380/1"),
    ("redis://redis:6379/0", "redis://redis:6379/0"),
    ("redis://app@redis:6379/0", "redis://app@redis:6379/0"),
])
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


# --- Redis options ----------------------------------------------------------------------------------------


def test_redis_options_validate_against_the_url(pki) -> None:
    ca, _, _ = pki
    with pytest.raises(ValueError, match=r"--redis-ca-file needs a rediss:// \(TLS\) redis_url, got 'redis://h:1/0'"):
        RedisOptions(ca_file=str(ca.cert)).check_url("redis://h:1/0")
    with pytest.raises(ValueError, match=r"carries a password and --redis-password-file") as info:
        RedisOptions(password="other").check_url(f"redis://:{SECRET}@h:1/0")
    assert SECRET not in str(info.value) and "***" in str(info.value)
    with pytest.raises(ValueError, match=r"redis_url must start with redis://.*got 'http://u:\*\*\*@h/'"):
        connect(f"http://u:{SECRET}@h/")
    assert SECRET not in repr(RedisOptions(password=SECRET))


def test_connect_passes_password_and_ca(pki) -> None:
    ca, _, _ = pki
    client = connect("rediss://h:6380/0", options=RedisOptions(password=SECRET, ca_file=str(ca.cert)))
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["password"] == SECRET and kwargs["ssl_ca_certs"] == str(ca.cert)
    assert issubclass(client.connection_pool.connection_class, SSLConnection)  # TLS (its commands packed in C)
    asyncio.run(client.aclose())
    plain = connect("redis://h:6379/0")  # the old call form still works
    assert plain.connection_pool.connection_kwargs.get("password") is None
    asyncio.run(plain.aclose())


def test_redis_auth_against_a_real_server() -> None:
    import redis  # noqa: PLC0415

    from shared.redis_server import RedisServer  # noqa: PLC0415

    with RedisServer(password=SECRET) as server:
        assert SECRET not in server.url
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).ping()

        async def ping(options: RedisOptions) -> bool:
            client = connect(server.url, options=options)
            try:
                return bool(await client.ping())
            finally:
                await client.aclose()

        assert asyncio.run(ping(RedisOptions(password=SECRET)))
        with pytest.raises(redis.AuthenticationError):
            asyncio.run(ping(RedisOptions(password="wrong")))


# --- command line -----------------------------------------------------------------------------------------


def test_flags_exist_on_each_command(tmp_path: Path) -> None:
    parser = build_parser()
    args = parser.parse_args(["scheduler", "--redis-url", "redis://r:6379/0", "--tls-cert-file", "c", "--tls-key-file",
                              "k", "--auth-token-file", "t", "--worker-tls-ca-file", "ca", "--worker-tls-cert-file",
                              "wc", "--worker-tls-key-file", "wk", "--redis-password-file", "p", "--redis-ca-file", "r"])
    assert (args.tls_cert_file, args.worker_tls_ca_file, args.redis_password_file) == ("c", "ca", "p")
    args = parser.parse_args(["worker", "--tls-cert-file", "c", "--tls-key-file", "k", "--tls-client-ca-file", "ca"])
    assert args.tls_client_ca_file == "ca"
    for command in (["generate"], ["openai"]):
        args = parser.parse_args([*command, "--tls-ca-file", "ca", "--auth-token-file", "t"])
        assert (args.tls_ca_file, args.auth_token_file) == ("ca", "t")
    assert parser.parse_args(["openai", "--api-key-file", "k"]).api_key_file == "k"


def test_token_from_the_environment_through_the_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMSERVE_AUTH_TOKEN", SECRET)
    args = build_parser().parse_args(["generate"])
    assert sec.auth_token_from(args) == SECRET
    token_file = tmp_path / "token"
    token_file.write_text("x")
    monkeypatch.setenv("LLMSERVE_AUTH_TOKEN_FILE", str(token_file))  # the file flag's own variable
    with pytest.raises(ValueError, match="both set"):
        sec.auth_token_from(build_parser().parse_args(["generate"]))


def test_cli_reports_a_bad_tls_file_as_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--tls-ca-file", str(tmp_path / "missing-ca.pem"), "--prompt", "hi"])
    assert rc == 2
    assert "--tls-ca-file: cannot read CA certificate file" in capsys.readouterr().err


def test_up_needs_the_ca_of_its_certificate(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = main(["up", "--model", str(tmp_path), "--tls-cert-file", "c", "--tls-key-file", "k"])
    assert rc == 2
    assert "--tls-cert-file needs --tls-ca-file" in capsys.readouterr().err


# --- nothing from the network is unpickled or evaluated ------------------------------------------------------

SERVICE_PACKAGES = ("scheduler_service", "worker_service", "shared", "openai_api", "llmserve", "kernels", "protos")
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle"}


def _unsafe_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(f"from {node.module} import")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("eval", "exec"):
                found.append(f"{func.id}()")
            if isinstance(func, ast.Attribute) and func.attr == "load" and isinstance(func.value, ast.Name):
                if func.value.id == "yaml":
                    found.append("yaml.load() (use yaml.safe_load)")
                if func.value.id == "torch" and not any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
                                                        and k.value.value is True for k in node.keywords):
                    found.append("torch.load() without weights_only=True")
    return found


def test_no_pickle_or_eval_in_the_services() -> None:
    files = [p for pkg in SERVICE_PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    assert len(files) > 50, "the scan sees the packages"
    problems = [f"{p.relative_to(ROOT)}: {u}" for p in files for u in _unsafe_uses(p)]
    assert problems == []


def test_the_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    bad = tmp_path / "unsafe_sample.py"
    bad.write_text("import pickle\nimport torch\nx = eval('1')\ntorch.load('f')\ntorch.load('g', weights_only=True)\n")
    assert _unsafe_uses(bad) == ["import pickle", "eval()", "torch.load() without weights_only=True"]
