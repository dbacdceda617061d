// The test driver's shared pieces: the client from the command line and how outcomes print.
#pragma once

#include <functional>
#include <iostream>
#include <string>

#include "args.hpp"
#include "ferrum/client.hpp"

namespace check {

ferrum::Client client_from(const ferrum_args::Args& args);
// Runs fn and prints "<name> OK <what fn returned>" or "<name> <CODE> <REASON or ->".
void outcome(const std::string& name, const std::function<std::string()>& fn);
// The test prompt both clients use: n ids below vocab.
std::vector<uint32_t> prompt(uint32_t n, uint32_t vocab, uint32_t seed = 0);
int run_rpcs(const ferrum_args::Args& args);  // one line per RPC of the contract

}  // namespace check
