// Internal: the channel a Client opens and the deadline of each call.
#pragma once

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "ferrum/client.hpp"

namespace ferrum {

std::shared_ptr<grpc::Channel> make_channel(const std::string& target, const ClientOptions& options);
// The call's deadline and its ferrum-deadline-unix-ns header (wall-clock ns).
void set_deadline(grpc::ClientContext* ctx, const ClientOptions& options);

}  // namespace ferrum
