"""Reading a server's ``/metrics`` with ``prometheus_client``'s own parser (what a Prometheus
scraper understands), for tests and benchmarks."""

from __future__ import annotations


def samples(text: str, name: str, **labels: str) -> list[float]:
    """The values of every sample called ``name`` (a sample's full name: ``vllm:prompt_tokens_total``,
    ``..._bucket``, ``..._count``) whose labels include ``labels``, in exposition order. Text the
    parser refuses raises its ``ValueError``."""
    from prometheus_client.parser import text_string_to_metric_families

    return [s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def scrape(server, name: str, **labels: str) -> list[float]:
    """:func:`samples` of a running server's ``/metrics`` (``server.url``)."""
    import httpx

    return samples(httpx.get(server.url + "/metrics", timeout=10).text, name, **labels)
