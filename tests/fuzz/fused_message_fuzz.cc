// A fused message (cc/tf/planning/fusion.h) as a receiver meets it: the plan read off a transfer's
// rendezvous key (ParseFusedMember: group, member, slot offset and capacity, message size), then
// the member's slot in a message a peer wrote (ReadFusedSlot), its header decoded and its tensor
// made, as cc/tf/rendezvous/fused_receive.cc and tensor_receive.cc do. The input is the key's
// tensor name, a NUL, then the message's bytes (zeros past them up to the plan's size).
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "cc/tf/planning/fusion.h"
#include "cc/tf/messages/tensor_message.h"
#include "tests/fuzz/tensor_from_peer.h"

namespace {

constexpr char kTarget[] = "fused_message_fuzz";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const size_t end_of_name = in.find('\0');
  if (end_of_name == std::string_view::npos) return 0;
  const std::optional<tf_rdma::FusedMember> member = tf_rdma::ParseFusedMember(in.substr(0, end_of_name));
  if (!member) return 0;
  if (member->index >= member->count || member->offset > member->total ||
      member->capacity > member->total - member->offset) {
    tf_rdma::fuzz::Fail(kTarget, "a plan whose slot lies outside its message");
  }
  const std::string_view sent = in.substr(end_of_name + 1);
  std::vector<char> message(member->total);
  std::memcpy(message.data(), sent.data(), std::min<size_t>(sent.size(), message.size()));
  const char* slot = message.data() + member->offset;
  absl::StatusOr<std::string_view> header_message = tf_rdma::ReadFusedSlot(slot, member->capacity);
  if (!header_message.ok()) return 0;
  if (header_message->data() < slot || header_message->data() + header_message->size() > slot + member->capacity) {
    tf_rdma::fuzz::Fail(kTarget, "a member's message lies outside its slot");
  }
  if (header_message->empty()) return 0;  // the member travels on its own
  uint64_t data_offset = 0;
  absl::StatusOr<tf_rdma::TensorHeader> header =
      tf_rdma::DecodeHeader(header_message->data(), header_message->size(), &data_offset);
  if (!header.ok() || header->dead || !tf_rdma::TravelsInline(*header)) return 0;
  tf_rdma::fuzz::TensorFromPeer(kTarget, *header, header_message->substr(data_offset)).IgnoreError();
  return 0;
}
