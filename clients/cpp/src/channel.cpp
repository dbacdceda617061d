// The channel: plaintext, TLS or mTLS, a bearer token on every call, keepalive pings
// and message limits as the Python client sets them.
#include <fstream>
#include <sstream>

#include <grpcpp/security/credentials.h>

#include "channel.hpp"

namespace ferrum {

namespace {
std::string read_file(const std::string& path) {
  if (path.empty()) return "";
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}
}  // namespace

std::shared_ptr<grpc::Channel> make_channel(const std::string& target, const ClientOptions& o) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(o.max_message_bytes);
  args.SetMaxSendMessageSize(o.max_message_bytes);
  if (o.keepalive) {
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, o.keepalive->time_ms);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, o.keepalive->timeout_ms);
    // Newer gRPC closes a connection on an unanswered ping only after this; older
    // releases ignore the name.
    args.SetInt("grpc.http2.ping_timeout_ms", o.keepalive->timeout_ms);
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, o.keepalive->without_calls ? 1 : 0);
    // Keep pinging while a call waits on a silent server (gRPC stops after 2 by default).
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  }
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (o.tls) {
    if (o.tls->cert.empty() != o.tls->key.empty())
      throw std::invalid_argument("a client certificate needs its key (and the key its certificate)");
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = read_file(o.tls->ca);
    ssl.pem_private_key = read_file(o.tls->key);
    ssl.pem_cert_chain = read_file(o.tls->cert);
    creds = grpc::SslCredentials(ssl);
    if (!o.tls->server_name.empty()) args.SetSslTargetNameOverride(o.tls->server_name);
  } else if (!o.token.empty()) {
    // A token travels only over TLS or to a loopback peer (local credentials check it).
    creds = grpc::experimental::LocalCredentials(LOCAL_TCP);
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  if (!o.token.empty())  // sent as "authorization: Bearer <token>"
    creds = grpc::CompositeChannelCredentials(creds, grpc::AccessTokenCredentials(o.token));
  return grpc::CreateCustomChannel(target, creds, args);
}

void set_deadline(grpc::ClientContext* ctx, const ClientOptions& o) {
  if (!o.timeout) return;
  auto now = std::chrono::system_clock::now();
  ctx->set_deadline(now + *o.timeout);
  // The absolute deadline beside gRPC's relative one: a server that reads the call late
  // (it was frozen or stalled) refuses it instead of running it after the caller gave up.
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>((now + *o.timeout).time_since_epoch()).count();
  ctx->AddMetadata("ferrum-deadline-unix-ns", std::to_string(ns));
}

}  // namespace ferrum
