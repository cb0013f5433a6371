// Tree: latency of O(log n) hops instead of the ring's O(n).
//
// All-reduce uses a double binary tree (as NCCL does): the round is split in
// two halves, each reduced up one tree and broadcast back down it. Tree 0 is
// an in-order tree over the ranks, whose leaves are (nearly) the even labels;
// tree 1 is the same tree with every label shifted by one, so its leaves are
// odd ranks: at most one rank is a leaf in both and no rank's links idle. Each
// half is further cut into kPipelineChunks chunks so that every level of the
// tree works on a different chunk at once.
//
// Broadcast uses one binary tree rooted at the source (heap numbering),
// pipelined the same way.
#pragma once

#include "schedule.h"

namespace pycomm {

struct TreeNode {
  int parent = -1;        // rank, -1 for the root
  int children[2] = {-1, -1};
  int child_height[2] = {0, 0};
  int num_children = 0;
  int height = 0;         // leaves are 0
  int depth = 0;          // the root is 0
};

struct TreeSchedule {
  PYCOMM_HOST_DEVICE static int mod(int a, int n) { return ((a % n) + n) % n; }

  // Height of an in-order tree over `size` labels split at the middle.
  PYCOMM_HOST_DEVICE static int inorder_height(int size) {
    // The larger side of a split of `size` labels has size/2 of them.
    int h = 0;
    for (; size > 1; size /= 2) ++h;
    return h;
  }

  // Label <-> rank maps of the two all-reduce trees.
  PYCOMM_HOST_DEVICE static int label_to_rank(int tree, int label, int n) {
    return tree == 0 ? label : mod(label + 1, n);
  }
  PYCOMM_HOST_DEVICE static int rank_to_label(int tree, int rank, int n) {
    return tree == 0 ? rank : mod(rank - 1, n);
  }

  // Node `rank` of all-reduce tree `tree`: descend from the root of the
  // in-order tree over labels [0, n) until the label is the middle.
  PYCOMM_HOST_DEVICE static TreeNode allreduce_node(int tree, int rank, int n) {
    TreeNode node;
    const int x = rank_to_label(tree, rank, n);
    int lo = 0, hi = n - 1, parent_label = -1, depth = 0;
    while (true) {
      const int mid = (lo + hi) / 2;
      if (x == mid) break;
      parent_label = mid;
      if (x < mid) hi = mid - 1; else lo = mid + 1;
      ++depth;
    }
    const int mid = (lo + hi) / 2;
    node.parent = parent_label < 0 ? -1 : label_to_rank(tree, parent_label, n);
    node.depth = depth;
    node.height = inorder_height(hi - lo + 1);
    if (lo <= mid - 1) {
      node.children[node.num_children] = label_to_rank(tree, (lo + mid - 1) / 2, n);
      node.child_height[node.num_children++] = inorder_height(mid - lo);
    }
    if (mid + 1 <= hi) {
      node.children[node.num_children] = label_to_rank(tree, (mid + 1 + hi) / 2, n);
      node.child_height[node.num_children++] = inorder_height(hi - mid);
    }
    return node;
  }

  PYCOMM_HOST_DEVICE static int floor_log2(int v) {
    int r = 0;
    while (v > 1) { v >>= 1; ++r; }
    return r;
  }

  PYCOMM_HOST_DEVICE static TreeNode broadcast_node(int rank, int root, int n) {
    TreeNode node;
    const int x = mod(rank - root, n);
    node.parent = x == 0 ? -1 : mod((x - 1) / 2 + root, n);
    node.depth = floor_log2(x + 1);
    for (int c = 2 * x + 1; c <= 2 * x + 2; ++c)
      if (c < n) node.children[node.num_children++] = mod(c + root, n);
    return node;
  }

  PYCOMM_HOST_DEVICE static int num_chunks(Collective coll, int /*world*/) {
    return coll == Collective::kAllReduce ? 2 * kPipelineChunks : kPipelineChunks;
  }

  PYCOMM_HOST_DEVICE static int num_steps(Collective coll, int world) {
    if (world <= 1) return 0;
    if (coll == Collective::kAllReduce) return kPipelineChunks + 2 * inorder_height(world) - 1;
    if (coll == Collective::kBroadcast) return kPipelineChunks + floor_log2(world) - 1;
    return 0;
  }

  PYCOMM_HOST_DEVICE static int max_ops(int /*world*/) { return 16; }

  PYCOMM_HOST_DEVICE static int ops(Collective coll, int rank, int world, int root, int step,
                                    ScheduleOp* out) {
    if (world <= 1) return 0;
    constexpr int P = kPipelineChunks;
    int n = 0;
    if (coll == Collective::kBroadcast) {
      const TreeNode node = broadcast_node(rank, root, world);
      const int send_k = step - node.depth;  // forward chunk k at step k + depth
      if (send_k >= 0 && send_k < P)
        for (int i = 0; i < node.num_children; ++i) out[n++] = make_send(0, node.children[i], send_k);
      const int recv_k = step - node.depth + 1;  // receive it one step earlier
      if (node.parent >= 0 && recv_k >= 0 && recv_k < P)
        out[n++] = make_recv(OpKind::kRecvCopy, 0, node.parent, recv_k, step);
      return n;
    }
    if (coll != Collective::kAllReduce) return 0;
    const int H = inorder_height(world);
    TreeNode nodes[2] = {allreduce_node(0, rank, world), allreduce_node(1, rank, world)};
    // 1. Sends: partial sums up (chunk k at step k + height), final values
    //    down (chunk k at step k + H + depth).
    for (int t = 0; t < 2; ++t) {
      const TreeNode& nd = nodes[t];
      const int up_k = step - nd.height;
      if (nd.parent >= 0 && up_k >= 0 && up_k < P) out[n++] = make_send(0, nd.parent, t * P + up_k);
      const int down_k = step - H - nd.depth;
      if (down_k >= 0 && down_k < P)
        for (int i = 0; i < nd.num_children; ++i) out[n++] = make_send(1, nd.children[i], t * P + down_k);
    }
    // 2. Receives: children's partial sums one step before we send ours up
    //    (both children in one group: own + left + right), the final value
    //    from the parent one step before we forward it down.
    for (int t = 0; t < 2; ++t) {
      const TreeNode& nd = nodes[t];
      const int red_k = step - nd.height + 1;
      if (nd.num_children > 0 && red_k >= 0 && red_k < P)
        for (int i = 0; i < nd.num_children; ++i)
          out[n++] = make_recv(OpKind::kRecvReduce, 0, nd.children[i], t * P + red_k,
                               red_k + nd.child_height[i]);
      const int bc_k = step - H - nd.depth + 1;
      if (nd.parent >= 0 && bc_k >= 0 && bc_k < P)
        out[n++] = make_recv(OpKind::kRecvCopy, 1, nd.parent, t * P + bc_k, step);
    }
    return n;
  }
};

}  // namespace pycomm
