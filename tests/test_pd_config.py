"""``--kv-transfer-config`` is checked before anything starts, with errors naming the valid values;
``dcpgraph serve`` and ``dcpgraph proxy`` refuse bad P/D settings with exit code 2."""

from __future__ import annotations

import re

import pytest

from dcpgraph.errors import ConfigError
from dcpgraph.serving.kv_connector import parse_kv_transfer_config


def test_minimal_pair_and_defaults():
    producer = parse_kv_transfer_config('{"kv_role": "kv_producer", "kv_rank": 0, "kv_parallel_size": 2, "kv_port": 15000}')
    consumer = parse_kv_transfer_config({"kv_role": "kv_consumer", "kv_rank": 1, "kv_parallel_size": 2, "kv_port": 15000})
    assert producer.is_producer and not producer.is_consumer and producer.hosts_store
    assert consumer.is_consumer and not consumer.hosts_store
    assert (consumer.kv_ip, consumer.kv_connector, consumer.transfer_timeout_s) == ("127.0.0.1", "TorchDistributedConnector", 30.0)
    both = parse_kv_transfer_config({"kv_role": "kv_both", "kv_connector_extra_config": {"hold_timeout_s": 5}})
    assert both.is_producer and both.is_consumer and both.hold_timeout_s == 5.0
    assert parse_kv_transfer_config(both.to_json()) == both


@pytest.mark.parametrize("value, message", [
    ("{", "not valid JSON"),
    ("[1]", "JSON object"),
    ('{"kv_role": "prefill"}', "kv_role must be one of ['kv_producer', 'kv_consumer', 'kv_both']"),
    ('{"kv_role": "kv_producer", "kv_connector": "NixlConnector"}', "kv_connector must be one of ['TorchDistributedConnector']"),
    ('{"kv_role": "kv_producer", "kv_rank": 2, "kv_parallel_size": 2}', "kv_rank must be an int in [0, 1]"),
    ('{"kv_role": "kv_producer", "kv_port": 70000}', "kv_port must be an int in [1, 65535]"),
    ('{"kv_role": "kv_producer", "kv_buffer_size": 1}', "unknown key"),
    ('{"kv_role": "kv_producer", "kv_connector_extra_config": {"transfer_timeout_s": 0}}', "transfer_timeout_s must be a number > 0"),
    ('{"kv_role": "kv_producer", "kv_connector_extra_config": {"retries": 1}}', "takes"),
])
def test_bad_configs_name_the_valid_values(value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_kv_transfer_config(value)


def test_serve_refuses_a_bad_config_before_loading(tmp_path, capsys):
    from dcpgraph.serving.cli import main

    model = tmp_path / "m"
    model.mkdir()
    assert main([str(model), "--kv-transfer-config", '{"kv_role": "kv_middle"}']) == 2
    assert "kv_role must be one of" in capsys.readouterr().err


def test_proxy_needs_http_urls(capsys):
    from dcpgraph.serving.proxy import main

    assert main(["--prefill", "127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"]) == 2
    assert "http://" in capsys.readouterr().err
