// ordered_index.h: the ordered set behind every best-fit search (policies' free-block indexes).
//
// Note [A B+tree for best-fit searches]
// Best fit is a lower_bound on (stream or bucket, size, address) keys. A red-black tree
// (std::set) does it in O(log n), but every level is a separate node somewhere in memory: with
// 64k free holes a search visits ~18 nodes, an insert and an erase rebalance through more, and
// the micro benchmark's holes/ cost rose 1.7-2.4x from 1k to 64k holes on the H200's host. Here
// the keys sit in sorted arrays: leaves of up to 32 keys chained in order, inner nodes of up to
// 32 children that route by the first key of each child. 64k keys are three levels deep and a
// search reads a few contiguous lines per level, so the cost stays nearly flat as holes grow.
//
// What differs from std::set, and what callers rely on:
// - Any insert or erase invalidates every iterator. Loops that free while they walk collect
//   first (native's release loops do), and nodes erase by key, not by a stored iterator.
// - Empty nodes are removed, under-full ones are not merged: depth never exceeds what the
//   largest size reached needs, and an erase touches one leaf unless the leaf empties.
// - Routing invariant: in an inner node, every key under child j (j >= 1) is >= fence[j], and
//   every key under child j-1 is < fence[j]; fence[0] is not used. A lookup that lands at the end
//   of a leaf continues at the first key of the next leaf, which is therefore >= the key sought.
// - Nodes come from the index's own free lists. reserve(n) makes sure the next n inserts need no
//   allocation (for callers that insert where they must not throw).
// - check() verifies order, counts, the chain and the routing invariant (used by tests and by
//   the policies' check_invariants()).
#pragma once

#include <algorithm>
#include <cstring>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <cachealloc/hot_pages.h>

namespace cachealloc {

template <class K, class Less = std::less<K>, int LeafCap = 16, int InnerCap = 32>
class OrderedIndex {
  static_assert(LeafCap >= 4 && InnerCap >= 4);
  static constexpr int kLeafCap = LeafCap;
  static constexpr int kInnerCap = InnerCap;
  static constexpr int kMaxHeight = 16;  // 32^16 keys: never reached

  struct Leaf {
    int count = 0;
    Leaf* prev = nullptr;
    Leaf* next = nullptr;  // also the free list's link
    K keys[kLeafCap];
  };
  struct Inner {
    int count = 0;             // children
    Inner* next_free = nullptr;
    K fences[kInnerCap];       // fences[0] unused
    void* child[kInnerCap];    // Leaf* at height 1, Inner* above
  };

 public:
  class iterator {
   public:
    using iterator_category = std::bidirectional_iterator_tag;
    using value_type = K;
    using difference_type = std::ptrdiff_t;
    using pointer = const K*;
    using reference = const K&;

    iterator() = default;
    const K& operator*() const noexcept { return leaf_->keys[i_]; }
    const K* operator->() const noexcept { return &leaf_->keys[i_]; }
    iterator& operator++() noexcept {
      if (++i_ == leaf_->count) {
        leaf_ = leaf_->next;
        i_ = 0;
      }
      return *this;
    }
    iterator operator++(int) noexcept {
      iterator before = *this;
      ++*this;
      return before;
    }
    iterator& operator--() noexcept {  // also from end(): the last key
      if (leaf_ == nullptr) {
        leaf_ = owner_->tail_;
        i_ = leaf_->count - 1;
      } else if (i_ == 0) {
        leaf_ = leaf_->prev;
        i_ = leaf_->count - 1;
      } else {
        --i_;
      }
      return *this;
    }
    friend bool operator==(const iterator& a, const iterator& b) noexcept {
      return a.leaf_ == b.leaf_ && a.i_ == b.i_;
    }

   private:
    friend class OrderedIndex;
    iterator(const OrderedIndex* owner, Leaf* leaf, int i) noexcept : owner_(owner), leaf_(leaf), i_(i) {}
    const OrderedIndex* owner_ = nullptr;
    Leaf* leaf_ = nullptr;  // nullptr: end()
    int i_ = 0;
  };
  using const_iterator = iterator;

  OrderedIndex() { clear(); }
  ~OrderedIndex() = default;
  OrderedIndex(const OrderedIndex&) = delete;
  OrderedIndex& operator=(const OrderedIndex&) = delete;

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  [[nodiscard]] int height() const noexcept { return height_; }
  /// Nodes ever allocated (in use or on the free lists).
  [[nodiscard]] std::size_t allocated_nodes() const noexcept { return leaf_store_.size() + inner_store_.size(); }

  [[nodiscard]] iterator begin() const noexcept {
    return head_->count == 0 ? end() : iterator(this, head_, 0);
  }
  [[nodiscard]] iterator end() const noexcept { return iterator(this, nullptr, 0); }

  /// The first key not less than `q` (Less must compare K with Q both ways).
  template <class Q>
  [[nodiscard]] iterator lower_bound(const Q& q) const noexcept {
    void* n = root_;
    for (int h = height_; h > 0; --h) {
      const auto* in = static_cast<const Inner*>(n);
      n = in->child[route(in, q)];
    }
    auto* leaf = static_cast<Leaf*>(n);
    int i = leaf_lower_bound(leaf, q);
    if (i == leaf->count) {
      leaf = leaf->next;
      i = 0;
    }
    return iterator(this, leaf, i);
  }

  /// The key equal to `q`, or end().
  template <class Q>
  [[nodiscard]] iterator find(const Q& q) const noexcept {
    iterator it = lower_bound(q);
    return it != end() && !less_(q, *it) ? it : end();
  }

  /// Inserts `key`; false (and nothing changes) when an equal key is present.
  bool insert(const K& key) {
    Path path;
    auto* leaf = descend(key, path);
    const int i = leaf_lower_bound(leaf, key);
    if (i < leaf->count && !less_(key, leaf->keys[i])) {
      return false;
    }
    if (leaf->count < kLeafCap) {
      shift_up(leaf->keys + i, leaf->keys + leaf->count);
      put_key(leaf->keys[i], key);
      ++leaf->count;
      ++size_;
      return true;
    }
    // Split: the lower half stays, the upper half moves to a new right neighbour.
    Leaf* right = new_leaf();
    K all[kLeafCap + 1];
    std::copy(leaf->keys, leaf->keys + i, all);
    put_key(all[i], key);
    std::copy(leaf->keys + i, leaf->keys + kLeafCap, all + i + 1);
    constexpr int kLeft = (kLeafCap + 1) / 2;
    std::copy(all, all + kLeft, leaf->keys);
    std::copy(all + kLeft, all + kLeafCap + 1, right->keys);
    leaf->count = kLeft;
    right->count = kLeafCap + 1 - kLeft;
    right->prev = leaf;
    right->next = leaf->next;
    if (leaf->next != nullptr) {
      leaf->next->prev = right;
    } else {
      tail_ = right;
    }
    leaf->next = right;
    ++size_;
    insert_child(path, path.depth, right->keys[0], right);
    return true;
  }

  /// Removes the key equal to `q`; false when there is none.
  template <class Q>
  bool erase(const Q& q) noexcept {
    Path path;
    auto* leaf = descend(q, path);
    const int i = leaf_lower_bound(leaf, q);
    if (i == leaf->count || less_(q, leaf->keys[i])) {
      return false;
    }
    erase_at(path, leaf, i);
    return true;
  }

  /// Erases the key at `it`; returns the iterator to the key after it.
  iterator erase(iterator it) noexcept {
    const K key = *it;
    if (it.leaf_->count > 1) {  // the leaf stays: shift in place, no descent
      Leaf* leaf = it.leaf_;
      shift_down(leaf->keys + it.i_, leaf->keys + leaf->count);
      --leaf->count;
      --size_;
      return it.i_ == leaf->count ? iterator(this, leaf->next, 0) : iterator(this, leaf, it.i_);
    }
    erase(key);
    return lower_bound(key);
  }

  /// Replaces the key equal to `old_key` by `key` (false, nothing changed, when there is none).
  /// One descent: the key moves inside its leaf when it stays within the fences that route to
  /// the leaf (Note [Moving a key inside its leaf]), else it is erased there and `key` inserted.
  template <class Q>
  bool update(const Q& old_key, const K& key) {
    Path path;
    Leaf* leaf = descend(old_key, path);
    const int i = leaf_lower_bound(leaf, old_key);
    if (i == leaf->count || less_(old_key, leaf->keys[i])) {
      return false;
    }
    const K& old = leaf->keys[i];
    if (in_leaf_range(path, key)) {
      const int last = leaf->count - 1;
      K* keys = leaf->keys;
      int j = i;
      if (less_(key, old)) {  // moves left: shift keys[j-1] right while they sort after `key`
        while (j > 0 && less_(key, keys[j - 1])) {
          keys[j] = keys[j - 1];
          --j;
        }
      } else {
        while (j < last && less_(keys[j + 1], key)) {
          keys[j] = keys[j + 1];
          ++j;
        }
      }
      put_key(keys[j], key);
      return true;
    }
    erase_at(path, leaf, i);
    insert(key);
    return true;
  }

  /// Removes every key; the nodes go back to the free lists for reuse.
  void clear() {
    free_leaves_ = nullptr;
    free_leaf_count_ = 0;
    for (auto& l : leaf_store_) {
      push_leaf(l.get());
    }
    free_inners_ = nullptr;
    free_inner_count_ = 0;
    for (auto& n : inner_store_) {
      push_inner(n.get());
    }
    height_ = 0;
    size_ = 0;
    Leaf* root = new_leaf();  // allocates only the first time
    root_ = head_ = tail_ = root;
  }

  /// Makes every insert allocation-free until size() reaches `keys`. A leaf splits only when
  /// full and leaves halves of at least kLeafCap / 2 keys, so growing to `keys` splits at most
  /// keys / (kLeafCap / 2 - 1) + 1 leaves; inner nodes likewise, per level, plus a new root.
  void reserve_total(std::size_t keys) {
    if (keys <= size_) {
      return;
    }
    const std::size_t leaf_splits = keys / (kLeafCap / 2 - 1) + 1;
    const std::size_t inner_splits = (leaf_count() + leaf_splits) / (kInnerCap / 2 - 1) + 1;
    const std::size_t levels = static_cast<std::size_t>(height_) + 2;
    while (free_leaf_count_ < leaf_splits) {
      push_leaf(make_leaf());
    }
    while (free_inner_count_ < inner_splits * levels) {
      push_inner(make_inner());
    }
  }

  /// Throws std::logic_error describing the first broken structural rule.
  void check() const {
    std::size_t counted = 0;
    check_node(root_, height_, nullptr, nullptr, counted);
    if (counted != size_) {
      fail("size " + std::to_string(size_) + " but " + std::to_string(counted) + " keys in leaves");
    }
    std::size_t chained = 0;
    const Leaf* prev = nullptr;
    for (const Leaf* l = head_; l != nullptr; l = l->next) {
      if (l->prev != prev) {
        fail("leaf chain: broken back link");
      }
      if (l->count == 0 && !(height_ == 0 && l == root_)) {
        fail("leaf chain: empty leaf");
      }
      if (prev != nullptr && prev->count > 0 && l->count > 0 && !less_(prev->keys[prev->count - 1], l->keys[0])) {
        fail("leaf chain: keys out of order across leaves");
      }
      chained += static_cast<std::size_t>(l->count);
      prev = l;
    }
    if (prev != tail_) {
      fail("leaf chain: tail is not the last leaf");
    }
    if (chained != size_) {
      fail("leaf chain holds " + std::to_string(chained) + " keys, size is " + std::to_string(size_));
    }
  }

 private:
  /// Stores a caller's key into a leaf slot. Callers build keys field by field just before the
  /// call; a plain struct copy reads them back with 16-byte loads that cannot be forwarded from
  /// the pending 8-byte stores (a store-forwarding stall: ~40% of defrag's pair in perf). Word
  /// by word, each load matches a store; the empty asm keeps the compiler from merging them.
  static void put_key(K& slot, const K& key) noexcept {
    if constexpr (std::is_trivially_copyable_v<K> && sizeof(K) % sizeof(std::uint64_t) == 0) {
      const auto* from = reinterpret_cast<const unsigned char*>(&key);
      auto* to = reinterpret_cast<unsigned char*>(&slot);
      for (std::size_t w = 0; w < sizeof(K) / sizeof(std::uint64_t); ++w) {
        std::uint64_t word = 0;
        std::memcpy(&word, from + w * sizeof word, sizeof word);
#if defined(__GNUC__)
        asm("" : "+r"(word));
#endif
        std::memcpy(to + w * sizeof word, &word, sizeof word);
      }
    } else {
      slot = key;
    }
  }

  // Note [Shifting keys in a leaf]
  // A leaf insert or erase moves the keys after the slot by one, a few on average. As
  // std::move_backward / std::move they became calls of libc's memmove, whose code is cold in
  // a training step like the rest (2,680 calls on the e2e pipeline recording: 3% of the cold
  // calls' instruction-cache misses, callgrind, session 24). One key at a time, inline; the
  // empty asm keeps the compiler from turning the loop back into a memmove call.
  /// Moves [first, last) up by one slot (last is written).
  static void shift_up(K* first, K* last) noexcept {
    for (K* p = last; p != first;) {
      --p;
      p[1] = p[0];
#if defined(__GNUC__)
      asm("" : "+r"(p));
#endif
    }
  }
  /// Moves (gap, last) down by one slot onto gap.
  static void shift_down(K* gap, K* last) noexcept {
    for (K* p = gap; p + 1 != last; ++p) {
      p[0] = p[1];
#if defined(__GNUC__)
      asm("" : "+r"(p));
#endif
    }
  }

  struct Path {
    Inner* node[kMaxHeight];
    int child[kMaxHeight];
    int depth = 0;  // entries used: node[0] is the root
  };

  template <class Q>
  int route(const Inner* in, const Q& q) const noexcept {
    // The last child j with fence[j] <= q (child 0 when q is below fence[1]).
    int lo = 1;
    int hi = in->count;  // first j in [1, count) with q < fence[j]
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (less_(q, in->fences[mid])) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    return lo - 1;
  }

  template <class Q>
  int leaf_lower_bound(const Leaf* leaf, const Q& q) const noexcept {
    int lo = 0;
    int hi = leaf->count;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (less_(leaf->keys[mid], q)) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    return lo;
  }

  template <class Q>
  Leaf* descend(const Q& q, Path& path) const noexcept {
    void* n = root_;
    path.depth = 0;
    for (int h = height_; h > 0; --h) {
      auto* in = static_cast<Inner*>(n);
      const int c = route(in, q);
      path.node[path.depth] = in;
      path.child[path.depth] = c;
      ++path.depth;
      n = in->child[c];
    }
    return static_cast<Leaf*>(n);
  }

  // Note [Moving a key inside its leaf]
  // A leaf may hold any key within the fences that route to it: at least the fence of its own
  // child slot at the deepest level where that slot is not the first (no bound if there is none),
  // below the fence of the next slot at the deepest level where there is a next. A re-keyed key
  // that stays within them stays in the leaf, shifted to its place, whether or not it passes the
  // leaf's first or last key. update() used to keep a key in its leaf only while it stayed
  // between the leaf's first and last keys, so a hole at either end of a leaf was erased and
  // inserted again whenever it shrank or grew: 1,709 of 3,689 updates on the e2e pipeline
  // recording (callgrind, cachealloc-cold-replay, session 24), each a second descent.
  template <class Q>
  bool in_leaf_range(const Path& path, const Q& key) const noexcept {
    bool have_low = false;
    bool have_high = false;
    for (int d = path.depth - 1; d >= 0 && !(have_low && have_high); --d) {
      const Inner* in = path.node[d];
      const int c = path.child[d];
      if (!have_low && c > 0) {
        if (less_(key, in->fences[c])) {
          return false;
        }
        have_low = true;
      }
      if (!have_high && c + 1 < in->count) {
        if (!less_(key, in->fences[c + 1])) {
          return false;
        }
        have_high = true;
      }
    }
    return true;
  }

  void erase_at(Path& path, Leaf* leaf, int i) noexcept {
    shift_down(leaf->keys + i, leaf->keys + leaf->count);
    --leaf->count;
    --size_;
    if (leaf->count == 0 && height_ > 0) {
      unlink_leaf(leaf);
      remove_child(path, path.depth);
    }
  }

  /// Puts (fence, node) right after the child that path[level - 1] descended into; splits up.
  void insert_child(Path& path, int level, const K& fence, void* node) {
    if (level == 0) {  // the root split: a new root above it
      Inner* root = new_inner();
      root->count = 2;
      root->child[0] = root_;
      root->child[1] = node;
      root->fences[1] = fence;
      root_ = root;
      ++height_;
      return;
    }
    Inner* in = path.node[level - 1];
    const int at = path.child[level - 1] + 1;
    if (in->count < kInnerCap) {
      std::move_backward(in->fences + at, in->fences + in->count, in->fences + in->count + 1);
      std::move_backward(in->child + at, in->child + in->count, in->child + in->count + 1);
      in->fences[at] = fence;
      in->child[at] = node;
      ++in->count;
      return;
    }
    K fences[kInnerCap + 1];
    void* children[kInnerCap + 1];
    std::copy(in->fences, in->fences + at, fences);
    std::copy(in->child, in->child + at, children);
    fences[at] = fence;
    children[at] = node;
    std::copy(in->fences + at, in->fences + kInnerCap, fences + at + 1);
    std::copy(in->child + at, in->child + kInnerCap, children + at + 1);
    constexpr int kLeft = (kInnerCap + 1) / 2;
    Inner* right = new_inner();
    std::copy(fences, fences + kLeft, in->fences);
    std::copy(children, children + kLeft, in->child);
    std::copy(fences + kLeft, fences + kInnerCap + 1, right->fences);
    std::copy(children + kLeft, children + kInnerCap + 1, right->child);
    in->count = kLeft;
    right->count = kInnerCap + 1 - kLeft;
    // right->fences[0] is the separator between `in` and `right` one level up.
    insert_child(path, level - 1, right->fences[0], right);
  }

  /// Removes the child that path[level - 1] descended into (it emptied); collapses upwards.
  void remove_child(Path& path, int level) noexcept {
    Inner* in = path.node[level - 1];
    const int at = path.child[level - 1];
    std::move(in->fences + at + 1, in->fences + in->count, in->fences + at);
    std::move(in->child + at + 1, in->child + in->count, in->child + at);
    --in->count;
    if (in->count == 0) {  // cannot be the root: a root keeps at least 2 children
      push_inner(in);
      remove_child(path, level - 1);
      return;
    }
    // A root with one child is replaced by it.
    while (height_ > 0 && static_cast<Inner*>(root_)->count == 1) {
      auto* old = static_cast<Inner*>(root_);
      root_ = old->child[0];
      push_inner(old);
      --height_;
    }
  }

  void unlink_leaf(Leaf* leaf) noexcept {
    if (leaf->prev != nullptr) {
      leaf->prev->next = leaf->next;
    } else {
      head_ = leaf->next;
    }
    if (leaf->next != nullptr) {
      leaf->next->prev = leaf->prev;
    } else {
      tail_ = leaf->prev;
    }
    push_leaf(leaf);
  }

  void check_node(const void* n, int h, const K* lo, const K* hi, std::size_t& counted) const {
    // Every key under n lies in [lo, hi) (either bound may be absent).
    auto in_range = [&](const K& k) {
      return (lo == nullptr || !less_(k, *lo)) && (hi == nullptr || less_(k, *hi));
    };
    if (h == 0) {
      const auto* leaf = static_cast<const Leaf*>(n);
      for (int i = 0; i < leaf->count; ++i) {
        if (!in_range(leaf->keys[i])) {
          fail("a key lies outside the range its inner nodes route to it");
        }
        if (i > 0 && !less_(leaf->keys[i - 1], leaf->keys[i])) {
          fail("keys out of order inside a leaf");
        }
      }
      counted += static_cast<std::size_t>(leaf->count);
      return;
    }
    const auto* in = static_cast<const Inner*>(n);
    if (in->count < 1 || (n == root_ && in->count < 2)) {
      fail("inner node with too few children");
    }
    for (int j = 0; j < in->count; ++j) {
      const K* clo = j == 0 ? lo : &in->fences[j];
      const K* chi = j + 1 < in->count ? &in->fences[j + 1] : hi;
      if (j + 1 < in->count && j > 0 && !less_(in->fences[j], in->fences[j + 1])) {
        fail("fences out of order");
      }
      check_node(in->child[j], h - 1, clo, chi, counted);
    }
  }

  [[noreturn]] static void fail(const std::string& what) {
    throw std::logic_error("OrderedIndex: " + what);
  }

  [[nodiscard]] std::size_t leaf_count() const noexcept { return leaf_store_.size() - free_leaf_count_; }
  // Note [Bookkeeping on few pages] (hot_pages.h): nodes come from the allocator's regions.
  Leaf* make_leaf() {
    leaf_store_.push_back(hot::make<Leaf>());
    return leaf_store_.back().get();
  }
  Inner* make_inner() {
    inner_store_.push_back(hot::make<Inner>());
    return inner_store_.back().get();
  }
  void push_leaf(Leaf* l) noexcept {
    l->count = 0;
    l->prev = nullptr;
    l->next = free_leaves_;
    free_leaves_ = l;
    ++free_leaf_count_;
  }
  Leaf* pop_leaf() noexcept {
    Leaf* l = free_leaves_;
    free_leaves_ = l->next;
    l->next = nullptr;
    --free_leaf_count_;
    return l;
  }
  void push_inner(Inner* n) noexcept {
    n->count = 0;
    n->next_free = free_inners_;
    free_inners_ = n;
    ++free_inner_count_;
  }
  Leaf* new_leaf() { return free_leaves_ != nullptr ? pop_leaf() : make_leaf(); }
  Inner* new_inner() {
    if (free_inners_ == nullptr) {
      return make_inner();
    }
    Inner* n = free_inners_;
    free_inners_ = n->next_free;
    --free_inner_count_;
    return n;
  }

  [[no_unique_address]] Less less_{};
  void* root_ = nullptr;
  Leaf* head_ = nullptr;  // first leaf of the chain
  Leaf* tail_ = nullptr;  // last leaf
  int height_ = 0;        // inner levels above the leaves
  std::size_t size_ = 0;
  std::vector<hot::Ptr<Leaf>> leaf_store_;
  std::vector<hot::Ptr<Inner>> inner_store_;
  Leaf* free_leaves_ = nullptr;
  Inner* free_inners_ = nullptr;
  std::size_t free_leaf_count_ = 0;
  std::size_t free_inner_count_ = 0;
};

}  // namespace cachealloc
