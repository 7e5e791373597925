// The cryptographic primitives tf_rdma uses, from OpenSSL's libcrypto (3.x): HMAC-SHA-256 for the
// handshake's proofs, HKDF-SHA-256 for the cluster key, SHA-256 for tensor tags, RAND_bytes for
// nonces and secrets, CRYPTO_memcmp to compare proofs.
//
// libcrypto.so.3 is loaded at run time (dlopen), not linked, for two reasons: TensorFlow's
// libtensorflow_framework.so.2, which the TensorFlow extension links, exports BoringSSL's functions
// under the same names (HMAC, EVP_sha256, RAND_bytes, ...), so a linked OpenSSL call could bind to
// BoringSSL's symbol depending on load order, whereas dlsym on libcrypto's own handle cannot (and
// libcrypto's calls to itself are kept from them too: crypto.cc, RTLD_DEEPBIND); and
// building needs no OpenSSL headers (pip install from source works without libssl-dev). Running
// needs libcrypto.so.3, which every distribution whose Python has hashlib/ssl installs.
//
// Every function but LoadCrypto may run only after LoadCrypto() returned OK; CreateTransport and
// the TensorFlow runtime's start check it, so every entry into tf_rdma is gated.
#ifndef TF_RDMA_CC_TRANSPORT_CRYPTO_H_
#define TF_RDMA_CC_TRANSPORT_CRYPTO_H_

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace tf_rdma {

using Sha256Digest = std::array<uint8_t, 32>;

// Loads libcrypto.so.3 and resolves the functions above, once per process (later calls return the
// first answer). Otherwise FailedPrecondition naming the library and the package that installs it.
absl::Status LoadCrypto();

// Appends `field` after its length (u32, little endian), so that fields so framed never encode two
// sequences alike: the inputs of the handshake's tokens and of the cluster key are built so.
void AppendLengthPrefixed(std::string& out, std::string_view field);

Sha256Digest Sha256(std::string_view data);
Sha256Digest HmacSha256(std::string_view key, std::string_view message);
// HKDF-SHA-256 (RFC 5869), extract and expand, to `length` bytes (at most 8160).
absl::Status HkdfSha256(std::string_view secret, std::string_view salt, std::string_view info,
                        uint8_t* out, size_t length);
// Bytes from OpenSSL's CSPRNG.
absl::Status RandomBytes(uint8_t* out, size_t length);

// Compares in time independent of where they differ, so timing does not tell how much of a guess
// was right.
bool DigestsEqual(const Sha256Digest& a, const Sha256Digest& b);

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_CRYPTO_H_
