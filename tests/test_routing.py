"""The approximate prefix tree and the routing policies, in pure Python (no model, no server)."""
from __future__ import annotations

import random

import pytest

from kvflow.core.prefix_tree import PrefixTree
from kvflow.core.routing import (POLICIES, CacheAware, CacheAwareConfig, LeastLoad, PowerOfTwo,
                                 RoundRobin, make_policy)


def check_invariants(tree: PrefixTree) -> None:
    """Every tenant on a node is on its parent; each tenant's size is its nodes' key lengths."""
    sizes: dict = {}
    stack = [tree.root]
    while stack:
        node = stack.pop()
        for c in node.children.values():
            assert c.parent is node and c.key and node.children[c.key[0]] is c
            assert set(c.tenants) <= set(node.tenants), "a child's tenant is missing on its parent"
            assert c.tenants or c.children, "a node nobody owns is kept"
            stack.append(c)
        if node is not tree.root:
            for t in node.tenants:
                sizes[t] = sizes.get(t, 0) + len(node.key)
    assert {t: s for t, s in sizes.items() if s} == {t: s for t, s in tree.sizes.items() if s}


def test_match_finds_each_tenants_longest_prefix():
    tree = PrefixTree()
    tree.insert("system: be brief. user: hello", "a")
    tree.insert("system: be brief. user: goodbye", "b")
    tree.insert("other", "b")
    best, per = tree.match("system: be brief. user: help me")
    assert per == {"a": len("system: be brief. user: hel"), "b": len("system: be brief. user: ")}
    assert best == per["a"]
    assert tree.match("nothing shared")[1] == {}
    assert tree.match("oth")[1] == {"b": 3}
    assert tree.size("a") == len("system: be brief. user: hello")
    assert tree.size("b") == len("system: be brief. user: goodbye") + len("other")
    check_invariants(tree)


def test_token_id_sequences_work_like_text():
    tree = PrefixTree()
    tree.insert([1, 2, 3, 4], 0)
    tree.insert([1, 2, 9], 1)
    assert tree.match([1, 2, 3, 7]) == (3, {0: 3, 1: 2})
    check_invariants(tree)


def test_eviction_drops_the_least_recently_used_leaves_first():
    tree = PrefixTree()
    tree.insert("aaaa-old", "r")
    tree.insert("bbbb-new", "r")
    tree.insert("aaaa-old", "s")  # another tenant keeps its own copy of the old branch
    assert tree.evict("r", 8) == 8
    assert tree.size("r") == 8
    assert tree.match("aaaa-old")[1] == {"s": 8}
    assert tree.match("bbbb-new")[1] == {"r": 8}
    check_invariants(tree)


def test_eviction_keeps_a_shared_stem_and_removes_whole_branches():
    tree = PrefixTree()
    tree.insert("stem-1", "r")
    tree.insert("stem-2", "r")
    tree.insert("stem-3", "r")  # the stem "stem-" and three one-character leaves
    tree.evict("r", 6)  # two leaves go, the oldest first
    assert tree.match("stem-3")[1] == {"r": 6}
    assert tree.match("stem-1")[1] == {"r": 5}
    tree.evict("r", 0)
    assert tree.size("r") == 0 and not tree.root.children
    check_invariants(tree)


def test_remove_tenant_forgets_it_and_prunes_the_tree():
    tree = PrefixTree()
    tree.insert("shared-x", "a")
    tree.insert("shared-y", "b")
    tree.remove_tenant("a")
    assert tree.match("shared-x")[1] == {"b": len("shared-")}
    assert tree.size("a") == 0
    check_invariants(tree)


def test_random_inserts_and_evictions_keep_the_invariants():
    rng = random.Random(7)
    tree = PrefixTree()
    for step in range(400):
        seq = "".join(rng.choice("abc") for _ in range(rng.randint(1, 12)))
        tenant = rng.randrange(3)
        tree.insert(seq, tenant)
        assert tree.match(seq)[1][tenant] == len(seq)
        if step % 7 == 0:
            tree.evict(rng.randrange(3), rng.randint(0, 30))
        if step % 97 == 0:
            tree.remove_tenant(rng.randrange(3))
        check_invariants(tree)
    for t in range(3):
        tree.evict(t, 10)
        assert tree.size(t) <= 10


def test_round_robin_cycles_and_power_of_two_takes_the_lighter_of_two():
    rr = RoundRobin()
    assert [rr.choose({"a": 5, "b": 0}, "k").replica for _ in range(4)] == ["a", "b", "a", "b"]
    p2 = PowerOfTwo(seed=1)
    assert {p2.choose({"a": 0, "b": 9}, "k").replica for _ in range(20)} == {"a"}


def test_least_load_breaks_ties_by_the_longest_prefix():
    ll = LeastLoad(tree=True)
    ll.routed(1, (5, 6, 7, 8))
    assert ll.choose({0: 0, 1: 0}, (5, 6, 7, 9)) .replica == 1
    assert ll.choose({0: 0, 1: 1}, (5, 6, 7, 9)).replica == 0  # load first
    ll.forget(1)
    assert ll.choose({0: 0, 1: 0}, (5, 6, 7, 9)).replica == 0


def test_cache_aware_follows_the_prefix_while_balanced():
    policy = CacheAware(CacheAwareConfig(cache_threshold=0.5, balance_abs_threshold=2))
    system = "You are a helpful assistant. Answer briefly. "
    first = policy.choose({"a": 0, "b": 0}, system + "Q1")
    assert first.reason == "smallest_tree"
    policy.routed(first.replica, system + "Q1")
    other = "b" if first.replica == "a" else "a"
    again = policy.choose({"a": 0, "b": 0}, system + "Q2")
    assert (again.replica, again.reason) == (first.replica, "cache_hit")
    assert again.matched == len(system + "Q")
    # a prompt sharing little goes to the replica with the smaller tree
    fresh = policy.choose({"a": 0, "b": 0}, "Translate this")
    assert (fresh.replica, fresh.reason) == (other, "smallest_tree")
    # the match wins over a small load difference
    loads = {first.replica: 2, other: 0}
    assert policy.choose(loads, system + "Q3").replica == first.replica


def test_cache_aware_goes_to_the_least_loaded_when_imbalanced():
    policy = CacheAware(CacheAwareConfig(balance_abs_threshold=4, balance_rel_threshold=1.5))
    policy.routed("a", "shared prompt")
    assert policy.choose({"a": 10, "b": 5}, "shared prompt").reason == "balance"
    assert policy.choose({"a": 10, "b": 5}, "shared prompt").replica == "b"
    # over the absolute threshold but not the relative one: the cache still decides
    assert policy.choose({"a": 30, "b": 25}, "shared prompt").replica == "a"


def test_cache_aware_ignores_a_match_on_a_replica_not_offered():
    policy = CacheAware()
    policy.routed("gone", "long shared system prompt")
    assert policy.choose({"a": 0}, "long shared system prompt").replica == "a"


def test_cache_aware_bounds_each_replicas_tree():
    policy = CacheAware(CacheAwareConfig(max_tree_size=100))
    for i in range(50):
        policy.routed("a", f"{i:04d}" + "x" * 20)
    assert policy.tree.size("a") <= 100
    check_invariants(policy.tree)


def test_make_policy_names_and_refusals():
    for name in POLICIES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("random")
    with pytest.raises(ValueError, match="cache_threshold"):
        CacheAwareConfig(cache_threshold=1.5)
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        CacheAwareConfig(balance_rel_threshold=0.5)


# -- the router's pieces that need no server --------------------------------------------------

def test_the_router_routes_chat_by_its_roles_and_contents_and_completions_by_the_prompt():
    from kvflow.entrypoints.router import MAX_KEY_CHARS, prompt_text

    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}) == "[1, 2, 3]"
    chat = {"messages": [{"role": "system", "content": "S"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}, 7]},
                         "junk", {"role": "assistant"}]}
    assert prompt_text(chat) == "<system>S<user>hi<assistant>"
    assert len(prompt_text({"prompt": "x" * (MAX_KEY_CHARS + 10)})) == MAX_KEY_CHARS
    assert prompt_text({"messages": "not a list"}) == ""
    assert prompt_text({"prompt": "abc", "cache_salt": "t1"}) == "t1\x00abc"


def test_the_router_routes_embeddings_responses_and_messages_by_their_text():
    from kvflow.entrypoints.router import prompt_text

    assert prompt_text({"input": "abc"}) == "abc"  # embeddings, Responses
    assert prompt_text({"input": ["first", "second"]}) == "first"
    assert prompt_text({"input": [[1, 2], [3]]}) == "[[1, 2], [3]]"
    assert prompt_text({"input": "q", "instructions": "Be brief"}) == "<system>Be brief" + "q"
    items = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                       {"type": "function_call_output", "output": "x"}]}
    assert prompt_text(items) == "<user>hi<None>"
    anthropic = {"system": [{"type": "text", "text": "S"}],
                 "messages": [{"role": "user", "content": "hi"}]}
    assert prompt_text(anthropic) == "<system>S<user>hi"


def test_the_router_remembers_a_bounded_number_of_response_homes():
    from kvflow.entrypoints.router_endpoints import ResponseHomes

    homes = ResponseHomes(max_items=2)
    homes.put("a", "http://r1")
    homes.put("b", "http://r2")
    assert homes.get("a") == "http://r1"  # now the most recently used
    homes.put("c", "http://r1")
    assert len(homes) == 2 and homes.get("b") is None and homes.get("a") == "http://r1"
    homes.forget("a")
    assert homes.get("a") is None


def test_a_responses_stream_is_read_for_its_id_across_chunks():
    from kvflow.entrypoints.router_endpoints import ResponseIdScan

    found = []
    scan = ResponseIdScan(found.append)
    stream = (b'event: response.created\ndata: {"type":"response.created","response":'
              b'{"id":"resp_1","status":"in_progress"}}\n\n'
              b'event: response.completed\ndata: {"type":"response.completed","response":'
              b'{"id":"resp_1"}}\n\n')
    for i in range(0, len(stream), 7):
        scan.feed(stream[i:i + 7])
    assert found == ["resp_1"]


@pytest.mark.parametrize("event, commits", [
    (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}', False),
    (b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}', True),
    (b'data: {"choices":[{"index":0,"text":"","finish_reason":null}]}', False),
    (b'data: {"choices":[{"index":0,"text":" the","finish_reason":null}]}', True),
    (b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}', True),
    (b'data: {"error":{"message":"boom"}}', True),
    (b'data: [DONE]', True),
    (b': keepalive', False),
    (b'event: response.created\ndata: {"type":"response.created","response":{}}', False),
    (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"a"}',
     True),
    (b'event: message_start\ndata: {"type":"message_start","message":{}}', False),
    (b'event: ping\ndata: {"type":"ping"}', False),
    (b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{}}', True),
    (b'event: error\ndata: {"type":"error","error":{}}', True),
])
def test_a_stream_is_held_back_until_its_first_token(event, commits):
    from kvflow.entrypoints.router import first_token_seen

    assert first_token_seen(event) is commits


@pytest.mark.parametrize("url", ["ftp://h:1", "http://", "http://h:1/?q=1", "http://u:p@h:1",
                                 "http://h:99999", 7, "", "http://h/" + "x" * 3000])
def test_a_worker_url_must_be_plain_http(url):
    from kvflow.entrypoints.router_workers import check_worker_url

    with pytest.raises(ValueError, match="url"):
        check_worker_url(url)


def test_health_thresholds_take_a_worker_out_and_back():
    from kvflow.entrypoints.router_workers import HealthConfig, Workers

    policy = CacheAware()
    workers = Workers({"replica": ["http://a:1/", "http://b:2"]}, {"replica": policy},
                      HealthConfig(failure_threshold=2, success_threshold=2))
    a = workers.find("http://a:1")
    policy.routed(a, "cached prompt")
    workers.mark(a, False)
    assert a.healthy
    workers.mark(a, False)
    assert not a.healthy and policy.tree.size(a) == 0  # out, and its tree forgotten
    workers.mark(a, True)
    assert not a.healthy
    workers.mark(a, True)
    assert a.healthy
    with pytest.raises(ValueError, match="already"):
        workers.add("http://a:1", "replica")
    with pytest.raises(ValueError, match="role"):
        workers.add("http://c:3", "decode")
    assert workers.remove("http://b:2/") is not None and workers.find("http://b:2") is None
