// HMAC-SHA-256 (RFC 2104 over FIPS 180-4), for the handshake's proof of a shared cluster key.
// Self-contained so that the transport needs no crypto library on the hosts it runs on.
#ifndef TF_RDMA_CC_TRANSPORT_HMAC_H_
#define TF_RDMA_CC_TRANSPORT_HMAC_H_

#include <array>
#include <cstdint>
#include <string_view>

namespace tf_rdma {

using Sha256Digest = std::array<uint8_t, 32>;

Sha256Digest Sha256(std::string_view data);
Sha256Digest HmacSha256(std::string_view key, std::string_view message);

// Compares without an early exit, so timing does not tell how much of a guess was right.
bool DigestsEqual(const Sha256Digest& a, const Sha256Digest& b);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_HMAC_H_
