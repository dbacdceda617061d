"""The C++ client as an installed package: `cmake --install` of the build the C++ tests
use puts it in a prefix, and a separate CMake project finds it with
find_package(ferrum_client), links ferrum_client::ferrum_client, waits for the model
with Client::wait_ready and decodes greedily: the same token ids as the Python client.
The installed headers name only the client's own types: no generated contract header
is installed, and a program using them compiles with the prefix's include folder alone,
reading no gRPC or protobuf header.

The prefix and the consumer's build folder live in the cache folder, next to the
client's own build (only the consumer's one source file compiles after the first run).
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from tests.conftest import running_server
from tests.contract.test_cpp_client import ROOT, build_dir, cpp_bin  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(600)

PROMPT = [1, 17, 42, 99, 7, 256, 3]

CONSUMER_CMAKE = """\
cmake_minimum_required(VERSION 3.16)
project(ferrum_consumer CXX)
set(CMAKE_CXX_STANDARD 17)
find_package(ferrum_client 0.2 CONFIG REQUIRED)
add_executable(consumer main.cpp)
target_link_libraries(consumer PRIVATE ferrum_client::ferrum_client)
add_executable(docs_example docs_example.cpp)  # docs/cpp-client.md's example, as printed
target_link_libraries(docs_example PRIVATE ferrum_client::ferrum_client)
"""

CONSUMER_MAIN = """\
// A program written against the installed headers only: greedy token ids, one a line.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <ferrum/client.hpp>

int main(int argc, char** argv) {
  ferrum::Client ex(argv[1]);
  if (!ex.wait_ready(std::chrono::seconds(60))) return 3;
  std::vector<uint32_t> prompt;
  for (int i = 3; i < argc; ++i) prompt.push_back(uint32_t(std::atoi(argv[i])));
  auto out = ex.prefill(prompt, ferrum::LogitsPolicy::argmax());
  uint32_t token = out.logits.argmax();
  ferrum::Handle handle = out.kv_cache;
  std::printf("%u\\n", token);
  for (int n = std::atoi(argv[2]) - 1; n > 0; --n) {
    auto step = ex.decode(token, handle, ferrum::LogitsPolicy::argmax());
    token = step.logits.argmax();
    handle = step.kv_cache;
    std::printf("%u\\n", token);
  }
  ex.release_cache(handle);
  return 0;
}
"""


def _run(*cmd, cwd=None, timeout=600) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def consumer(cpp_bin):  # noqa: F811
    """The client installed into a prefix, and the consumer built against that prefix."""
    place = build_dir().with_name(build_dir().name + "-install")
    prefix, source, build = place / "prefix", place / "consumer", place / "consumer-build"
    if (prefix / "include").exists():  # headers a previous install left (the generated ones, once)
        shutil.rmtree(prefix / "include")
    _run("cmake", "--install", cpp_bin, "--prefix", prefix)
    for installed in ("include/ferrum/client.hpp", "include/ferrum/types.hpp", "lib/libferrum_client.a",
                      "lib/cmake/ferrum_client/ferrum_clientConfig.cmake"):
        assert (prefix / installed).is_file(), f"cmake --install left out {installed}"
    source.mkdir(parents=True, exist_ok=True)
    for name, text in (("CMakeLists.txt", CONSUMER_CMAKE), ("main.cpp", CONSUMER_MAIN),
                       ("docs_example.cpp", docs_example())):
        if not (source / name).exists() or (source / name).read_text() != text:
            (source / name).write_text(text)
    _run("cmake", "-S", source, "-B", build, f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_BUILD_TYPE=Debug",
         "-DCMAKE_CXX_FLAGS_DEBUG=-O0")
    _run("cmake", "--build", build, "-j2", "--target", "consumer")
    return build / "consumer"


def docs_example() -> str:
    """The C++ block of docs/cpp-client.md."""
    text = (ROOT / "docs" / "cpp-client.md").read_text()
    blocks = re.findall(r"^```cpp\n(.*?)^```$", text, re.S | re.M)
    assert len(blocks) == 1, "docs/cpp-client.md: one ```cpp block expected"
    return blocks[0]


def test_a_find_package_consumer_decodes_as_the_python_client(consumer, tiny_llama_dir):
    with running_server(tiny_llama_dir) as server:
        with ExecutorClient(server.target, timeout=30) as py:
            out = py.prefill(PROMPT, logits=LogitsPolicy.argmax())
            want, handle = [out.logits.argmax()[0]], out.kv_cache
            for _ in range(15):
                step = py.decode(want[-1], handle, logits=LogitsPolicy.argmax())
                want.append(step.logits.argmax()[0])
                handle = step.kv_cache
            py.release_cache(handle)
        got = _run(consumer, server.target, 16, *PROMPT, timeout=120).stdout.split()
    assert [int(t) for t in got] == want


def test_wait_ready_waits_for_the_model_not_the_channel(consumer):
    """Started with the server process, before it listens or loads the default model:
    wait_ready returns only once the model serves, so the prefill after it succeeds
    (a wait for the channel alone returned while the model loaded: MODEL_LOADING)."""
    from ferrum_rpc.harness import serve_process
    from ferrum_rpc.server.prepare import prepare_default_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with serve_process(prepare_default_model(), "--no-warmup", port=port) as proc:
        done = subprocess.run([str(consumer), proc.target, "2", *map(str, PROMPT)], capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split()) == 2


def test_the_docs_example_builds_against_the_installed_package(consumer):
    build = consumer.parent
    _run("cmake", "--build", build, "-j2", "--target", "docs_example")
    assert (build / "docs_example").is_file()


def test_the_installed_headers_include_neither_grpc_nor_protobuf(consumer):
    """The consumer's source, preprocessed with the prefix's include folder as its only
    one: every header it reads is the standard library's or the client's own."""
    prefix = consumer.parents[1] / "prefix"
    generated = [p.relative_to(prefix) for p in (prefix / "include").rglob("*") if p.name.endswith((".pb.h", ".pb.hpp"))]
    assert not generated, f"generated contract headers installed: {generated}"
    source = consumer.parents[1] / "consumer" / "main.cpp"
    deps = _run("c++", "-std=c++17", f"-I{prefix / 'include'}", "-M", source).stdout
    headers = deps.replace("\\\n", " ").split()[2:]  # "main.o: main.cpp h1 h2 ..."
    own = [h for h in headers if h.startswith(str(prefix))]
    assert {Path(h).name for h in own} == {"client.hpp", "types.hpp"}, own
    leaked = [h for h in headers if "grpc" in h or "protobuf" in h or ".pb.h" in h]
    assert not leaked, f"the public headers pull in {leaked}"
