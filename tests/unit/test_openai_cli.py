"""`llmserve openai`, `llmserve up --http-port`, and the front's config defaults."""

from __future__ import annotations

import pytest

from openai_api.server import FrontConfig
from llmserve.cli import build_parser


def test_openai_command_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["openai", "--port", "9000", "--scheduler", "s:1", "--served-model-name", "a",
                                      "--served-model-name", "b"])
    assert (args.port, args.scheduler, args.served_model_name) == (9000, "s:1", ["a", "b"])
    monkeypatch.setenv("LLMSERVE_SCHEDULER", "env:50051")
    assert build_parser().parse_args(["openai"]).scheduler == "env:50051"


def test_up_starts_the_http_front_only_when_asked() -> None:
    assert build_parser().parse_args(["up"]).http_port is None
    assert build_parser().parse_args(["up", "--http-port", "8000"]).http_port == 8000


def test_served_model_name_defaults() -> None:
    assert FrontConfig(scheduler="s:1", tokenizer="/models/SmolLM2-135M-Instruct/").served_model_names == [
        "SmolLM2-135M-Instruct"]
    assert FrontConfig(scheduler="s:1", tokenizer="/m/model.Q4.gguf").served_model_names == ["model.Q4"]
    assert FrontConfig(scheduler="s:1").served_model_names == ["llmserve"]
    with pytest.raises(ValueError, match="port must be in"):
        FrontConfig(scheduler="s:1", port=70000)


def test_the_access_log_can_be_turned_off_and_logs_in_the_services_format(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmserve import cli
    from openai_api import server

    configs = []
    monkeypatch.setattr(server.uvicorn, "Server", lambda config: configs.append(config) or _NoServer())
    for flags, access_log in (([], True), (["--disable-uvicorn-access-log"], False)):
        assert cli.main(["openai", "--host", "127.0.0.1", "--port", "0", *flags]) == 0
        # uvicorn's own handlers and format left out: its records reach the root logger's single format.
        assert configs[-1].access_log is access_log and configs[-1].log_config is None


class _NoServer:
    def run(self, sockets: list) -> None:
        for sock in sockets:
            sock.close()


def test_auto_tool_choice_flags_go_together_and_reach_the_front(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from llmserve import cli
    from openai_api import server

    configs = []
    monkeypatch.setattr(server, "make_app", lambda config: configs.append(config))
    monkeypatch.setattr(server.uvicorn, "Server", lambda config: _NoServer())
    assert cli.main(["openai", "--port", "0", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) == 0
    assert [c.tool_call_parser for c in configs] == ["hermes"]
    assert cli.main(["openai", "--port", "0", "--return-tokens-as-token-ids"]) == 0
    assert configs[-1].return_tokens_as_token_ids and not configs[0].return_tokens_as_token_ids
    for flags in (["--enable-auto-tool-choice"], ["--tool-call-parser", "hermes"]):
        assert cli.main(["openai", "--port", "0", *flags]) == 2
        assert "--enable-auto-tool-choice and --tool-call-parser go together" in capsys.readouterr().err
    assert cli.main(["up", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) == 2
    assert "apply to the HTTP front: set --http-port" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json"):
        FrontConfig(scheduler="s:1", tool_call_parser="mistral")
    # `up` hands both flags to the front it starts.
    args = build_parser().parse_args(["up", "--http-port", "8000", "--enable-auto-tool-choice",
                                      "--tool-call-parser", "llama3_json"])
    assert cli._passthrough(args, cli._HTTP_PASS)[-3:] == ["--enable-auto-tool-choice", "--tool-call-parser",
                                                          "llama3_json"]


def test_a_request_names_tokens_by_id_or_text_over_the_fronts_default() -> None:
    from openai_api.logprobs import ID_NAMER, TokenNamer
    from openai_api.protocol import CompletionRequest
    from openai_api.routes import FrontState, _namer

    decoded = TokenNamer(type("Tok", (), {"decode": staticmethod(lambda ids: f"<{ids[0]}>")})())
    for default in (False, True):
        state = FrontState(engine=None, namer=decoded, model_names=["m"],  # type: ignore[arg-type]
                           tokens_as_ids=default)
        for asked, expected in ((None, "token_id:7" if default else "<7>"), (True, "token_id:7"), (False, "<7>")):
            namer = _namer(state, CompletionRequest(prompt="x", return_tokens_as_token_ids=asked))
            assert namer.name(7) == expected, (default, asked)
    assert ID_NAMER.name(3) == "token_id:3"
