#include "cc/tf/planning/fusion.h"

#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cc/tf/messages/tensor_message.h"
#include "cc/tf/runtime/task_names.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/graph/algorithm.h"
#include "tensorflow/core/util/device_name_utils.h"
#include "tsl/platform/random.h"

namespace tf_rdma {
namespace {

// On a node whose outputs are fused transfers: "<output>|<destination device>|<name suffix>".
constexpr char kFusedSendsAttr[] = "_rdma_fused_sends";
// On a node that consumes fused transfers: per input port, the transfer's name suffix, or "".
constexpr char kFusedInputsAttr[] = "_rdma_fused_inputs";
// What a fused transfer's tensor name gets: the marker, then the group and the member's layout.
constexpr char kMarker[] = "/rdma_fuse:";

// Larger tensors gain nothing from sharing a message: their bytes, not the message, cost.
constexpr uint64_t kMaxMemberBytes = kInlineBytes;
constexpr uint32_t kMaxMembers = 4096;
constexpr uint64_t kMaxMessageBytes = 16 << 20;

bool OnCpu(const std::string& device) {
  tensorflow::DeviceNameUtils::ParsedName parsed;
  return tensorflow::DeviceNameUtils::ParseFullName(device, &parsed) && parsed.type == "CPU";
}

struct Member {
  const tensorflow::Node* source;
  int output;
  int dims;
  uint64_t bytes;
  std::vector<const tensorflow::Edge*> edges;  // to its consumers on the destination device
};

struct Group {
  std::string from_device;
  std::string to_device;
  std::vector<Member> members;
};

// Per node, the most task boundaries a path from the graph's start to it crosses. Fusing only
// transfers whose sources are equally deep cannot make a cycle: along every edge depth never falls,
// and it rises across each fused message (its consumers are at least one boundary deeper than its
// sources), so a cycle through a fused message would have to come back to a shallower node.
std::vector<int> CrossingDepth(const tensorflow::Graph& graph) {
  std::vector<tensorflow::Node*> order;
  tensorflow::GetReversePostOrder(graph, &order);
  std::vector<int> depth(graph.num_node_ids(), 0);
  for (const tensorflow::Node* node : order) {
    for (const tensorflow::Edge* edge : node->in_edges()) {
      const bool crosses = CrossesTasks(edge->src()->assigned_device_name(), node->assigned_device_name());
      depth[node->id()] = std::max(depth[node->id()], depth[edge->src()->id()] + (crosses ? 1 : 0));
    }
  }
  return depth;
}

// Per node, which of the client's feeds it depends on (a bit each). A partial run (TF1's
// Session.partial_run) feeds them call by call, and a node runs only once all of its feeds came:
// fusing tensors that wait for different feeds could hold one call's tensor until a later call.
// Nothing when there are too many feeds to tell apart: such graphs are not fused.
std::optional<std::vector<uint64_t>> FeedsUpstream(const tensorflow::Graph& graph) {
  std::vector<tensorflow::Node*> order;
  tensorflow::GetReversePostOrder(graph, &order);
  std::vector<uint64_t> feeds(graph.num_node_ids(), 0);
  int next_feed = 0;
  for (const tensorflow::Node* node : order) {
    bool client_terminated = false;
    if (node->IsRecv() && tensorflow::TryGetNodeAttr(node->attrs(), "client_terminated", &client_terminated) &&
        client_terminated) {
      if (next_feed == 64) return std::nullopt;
      feeds[node->id()] |= uint64_t{1} << next_feed++;
    }
    for (const tensorflow::Edge* edge : node->in_edges()) feeds[node->id()] |= feeds[edge->src()->id()];
  }
  return feeds;
}

// Splits groups past the bounds of one message; drops those of one member.
std::vector<Group> Bounded(std::vector<Group> groups) {
  std::vector<Group> bounded;
  for (Group& group : groups) {
    Group chunk{group.from_device, group.to_device, {}};
    uint64_t bytes = 0;
    for (Member& member : group.members) {
      const uint64_t capacity = FusedSlotCapacity(member.dims, member.bytes);
      if (!chunk.members.empty() && (chunk.members.size() == kMaxMembers || bytes + capacity > kMaxMessageBytes)) {
        bounded.push_back(std::move(chunk));
        chunk = Group{group.from_device, group.to_device, {}};
        bytes = 0;
      }
      bytes += capacity;
      chunk.members.push_back(std::move(member));
    }
    bounded.push_back(std::move(chunk));
  }
  bounded.erase(std::remove_if(bounded.begin(), bounded.end(), [](const Group& g) { return g.members.size() < 2; }),
                bounded.end());
  return bounded;
}

void Record(const Group& group) {
  const uint64_t id = tsl::random::New64();
  uint64_t total = 0;
  for (const Member& member : group.members) total += FusedSlotCapacity(member.dims, member.bytes);
  uint64_t offset = 0;
  for (size_t i = 0; i < group.members.size(); ++i) {
    const Member& member = group.members[i];
    const uint64_t capacity = FusedSlotCapacity(member.dims, member.bytes);
    const std::string suffix = absl::StrCat(kMarker, id, ":", i, ":", group.members.size(), ":", offset, ":",
                                            capacity, ":", total);
    offset += capacity;
    // The partitioner copies nodes with their attributes: the source into the sending partition,
    // the consumers into the receiving one.
    auto* source = const_cast<tensorflow::Node*>(member.source);
    std::vector<std::string> sends;
    tensorflow::TryGetNodeAttr(source->attrs(), kFusedSendsAttr, &sends);
    sends.push_back(absl::StrCat(member.output, "|", group.to_device, "|", suffix));
    source->AddAttr(kFusedSendsAttr, sends);
    for (const tensorflow::Edge* edge : member.edges) {
      tensorflow::Node* consumer = edge->dst();
      std::vector<std::string> inputs;
      if (!tensorflow::TryGetNodeAttr(consumer->attrs(), kFusedInputsAttr, &inputs)) {
        inputs.assign(consumer->num_inputs(), "");
      }
      if (edge->dst_input() >= static_cast<int>(inputs.size())) continue;
      inputs[edge->dst_input()] = suffix;
      consumer->AddAttr(kFusedInputsAttr, inputs);
    }
  }
}

std::optional<std::string> SuffixOfSend(const tensorflow::Node& send) {
  std::string recv_device;
  const tensorflow::Edge* input = nullptr;
  std::vector<std::string> sends;
  if (!tensorflow::TryGetNodeAttr(send.attrs(), "recv_device", &recv_device) || !send.input_edge(0, &input).ok() ||
      !tensorflow::TryGetNodeAttr(input->src()->attrs(), kFusedSendsAttr, &sends)) {
    return std::nullopt;
  }
  const std::string prefix = absl::StrCat(input->src_output(), "|", recv_device, "|");
  for (const std::string& entry : sends) {
    if (entry.rfind(prefix, 0) == 0) return entry.substr(prefix.size());
  }
  return std::nullopt;
}

std::optional<std::string> SuffixOfRecv(const tensorflow::Node& recv) {
  for (const tensorflow::Edge* edge : recv.out_edges()) {
    std::vector<std::string> inputs;
    if (edge->IsControlEdge() || edge->src_output() != 0 ||
        !tensorflow::TryGetNodeAttr(edge->dst()->attrs(), kFusedInputsAttr, &inputs) ||
        edge->dst_input() >= static_cast<int>(inputs.size()) || inputs[edge->dst_input()].empty()) {
      continue;
    }
    return inputs[edge->dst_input()];
  }
  return std::nullopt;
}

}  // namespace

std::optional<FusedMember> ParseFusedMember(std::string_view tensor_name) {
  const size_t at = tensor_name.rfind(kMarker);
  if (at == std::string_view::npos) return std::nullopt;
  const std::vector<std::string_view> fields =
      absl::StrSplit(tensor_name.substr(at + sizeof(kMarker) - 1), ':');
  FusedMember member;
  if (fields.size() != 6 || !absl::SimpleAtoi(fields[0], &member.group) ||
      !absl::SimpleAtoi(fields[1], &member.index) || !absl::SimpleAtoi(fields[2], &member.count) ||
      !absl::SimpleAtoi(fields[3], &member.offset) || !absl::SimpleAtoi(fields[4], &member.capacity) ||
      !absl::SimpleAtoi(fields[5], &member.total) || member.index >= member.count || member.count > kMaxMembers ||
      member.capacity < FusedSlotCapacity(0, 0) ||
      member.total > kMaxMessageBytes || member.offset > member.total ||
      member.capacity > member.total - member.offset) {
    return std::nullopt;
  }
  return member;
}

void PlanFusion(tensorflow::Graph& graph, const std::vector<StaticTransfer>& transfers) {
  for (const tensorflow::Node* node : graph.op_nodes()) {
    // A step of a graph with control flow may not run every transfer (an untaken branch), or run
    // one many times (a loop): a group could wait for a member that never comes.
    if (node->IsControlFlow()) return;
  }
  // Keyed so that the plan depends on the graph alone: members in the order of their sources.
  const std::vector<int> depth = CrossingDepth(graph);
  const std::optional<std::vector<uint64_t>> feeds = FeedsUpstream(graph);
  if (!feeds) return;
  std::map<std::tuple<std::string, std::string, int, uint64_t>, std::map<std::pair<int, int>, Member>> candidates;
  for (const StaticTransfer& transfer : transfers) {
    const tensorflow::Edge* edge = transfer.edge;
    const std::string& from = edge->src()->assigned_device_name();
    const std::string& to = edge->dst()->assigned_device_name();
    if (transfer.bytes > kMaxMemberBytes || !OnCpu(from) || !OnCpu(to)) continue;
    auto [it, added] = candidates[{from, to, depth[edge->src()->id()], (*feeds)[edge->src()->id()]}].try_emplace(
        std::make_pair(edge->src()->id(), edge->src_output()),
        Member{edge->src(), edge->src_output(), transfer.dims, transfer.bytes, {}});
    it->second.edges.push_back(edge);
  }
  std::vector<Group> groups;
  for (auto& [key, members] : candidates) {
    Group group{std::get<0>(key), std::get<1>(key), {}};
    for (auto& [source, member] : members) group.members.push_back(std::move(member));
    groups.push_back(std::move(group));
  }
  for (const Group& group : Bounded(std::move(groups))) Record(group);
}

void NameFusedTransfers(tensorflow::Graph& partition) {
  for (tensorflow::Node* node : partition.op_nodes()) {
    if (!node->IsSend() && !node->IsRecv()) continue;
    std::string tensor_name;
    if (!tensorflow::TryGetNodeAttr(node->attrs(), "tensor_name", &tensor_name) ||
        tensor_name.find(kMarker) != std::string::npos) {
      continue;
    }
    const std::optional<std::string> suffix = node->IsSend() ? SuffixOfSend(*node) : SuffixOfRecv(*node);
    if (suffix) node->AddAttr("tensor_name", tensor_name + *suffix);
  }
}

}  // namespace tf_rdma
