// The embedded synthetic corpus: batches are pure functions of (seed, split, index), targets are
// the tokens shifted by one, arithmetic is correct, grammar documents stay inside the lexicon and
// agree in number, the arithmetic share follows the config, and the unigram entropy is in the
// range a byte-level English-plus-digits corpus should have.
#include <gtest/gtest.h>

#include <cctype>
#include <cstdio>
#include <map>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "fourbit/train/arithmetic.h"
#include "fourbit/train/grammar.h"
#include "fourbit/train/synthetic_source.h"
#include "train/data_test_util.h"

using namespace fourbit::data;
using namespace fourbit::data::testing;

namespace {

// The complete documents (between a <bos> and its <eos>) of a token sequence.
std::vector<std::string> documents(const std::vector<int32_t>& seq) {
  std::vector<std::string> docs;
  std::string cur;
  bool open = false;
  for (int32_t t : seq) {
    if (t == kBos) {
      EXPECT_FALSE(open) << "<bos> inside a document";
      open = true;
      cur.clear();
    } else if (t == kEos) {
      EXPECT_TRUE(open) << "<eos> without <bos>";
      open = false;
      docs.push_back(cur);
    } else {
      EXPECT_TRUE(open) << "text outside a document";
      EXPECT_TRUE(t >= 0 && t < 128) << "the synthetic corpus is ASCII, got id " << t;
      cur.push_back(char(t));
    }
  }
  return docs;
}

std::vector<std::string> split_on(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::string cur;
  std::istringstream in(s);
  while (std::getline(in, cur, sep)) parts.push_back(cur);
  return parts;
}

bool contains(std::span<const std::string_view> words, const std::string& w) {
  for (std::string_view x : words)
    if (x == w) return true;
  return false;
}

}  // namespace

TEST(SyntheticCorpus, BatchesArePureFunctionsOfSeedSplitAndIndex) {
  const SyntheticSource a(Split::Train, 1234, 0.4), b(Split::Train, 1234, 0.4);
  const Batch x = batch_of(a, 7, 4, 64);
  batch_of(b, 3, 4, 64);  // asking for other batches first changes nothing
  const Batch y = batch_of(b, 7, 4, 64);
  EXPECT_EQ(x.tokens, y.tokens);
  EXPECT_EQ(x.targets, y.targets);

  EXPECT_NE(batch_of(a, 8, 4, 64).tokens, x.tokens) << "another index";
  EXPECT_NE(batch_of(SyntheticSource(Split::Eval, 1234, 0.4), 7, 4, 64).tokens, x.tokens)
      << "the eval split";
  EXPECT_NE(batch_of(SyntheticSource(Split::Train, 1235, 0.4), 7, 4, 64).tokens, x.tokens)
      << "another seed";
  for (int64_t r = 1; r < 4; ++r) EXPECT_NE(x.row(r), x.row(0)) << "rows of one batch differ";

  // Sequence numbering is index * B + b: one batch of 4 is two batches of 2.
  const Batch lo = batch_of(a, 14, 2, 64), hi = batch_of(a, 15, 2, 64);
  EXPECT_EQ(x.row(0), lo.row(0));
  EXPECT_EQ(x.row(1), lo.row(1));
  EXPECT_EQ(x.row(2), hi.row(0));
  EXPECT_EQ(x.row(3), hi.row(1));
  // A longer window starts with the shorter one.
  const Batch longer = batch_of(a, 7, 4, 200);
  for (int64_t t = 0; t < 64; ++t) EXPECT_EQ(longer.tokens[size_t(200 + t)], x.tokens[size_t(64 + t)]);
}

TEST(SyntheticCorpus, TargetsAreTokensShiftedByOne) {
  const SyntheticSource src(Split::Train, 42, 0.4);
  const int64_t B = 8, T = 96;
  const Batch x = batch_of(src, 0, B, T);
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int32_t> w = src.sequence(sequence_number(0, B, b), T + 1);
    EXPECT_EQ(w[0], kBos) << "every sequence starts a document";
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(x.tokens[size_t(b * T + t)], w[size_t(t)]);
      EXPECT_EQ(x.targets[size_t(b * T + t)], w[size_t(t + 1)]);
      if (t + 1 < T) {
        EXPECT_EQ(x.targets[size_t(b * T + t)], x.tokens[size_t(b * T + t + 1)]);
      }
      EXPECT_GE(x.tokens[size_t(b * T + t)], 0);
      EXPECT_LT(x.tokens[size_t(b * T + t)], kVocabSize);
    }
  }
}

TEST(SyntheticCorpus, ArithmeticLinesAreCorrect) {
  const SyntheticSource src(Split::Train, 7, 1.0);
  int64_t lines = 0, docs = 0;
  std::set<char> ops;
  for (int64_t s = 0; s < 200; ++s) {
    for (const std::string& doc : documents(src.sequence(s, 300))) {
      ++docs;
      ASSERT_FALSE(doc.empty());
      ASSERT_EQ(doc.back(), '\n') << doc;
      const std::vector<std::string> ls = split_on(doc, '\n');
      EXPECT_GE(ls.size(), 2u);
      EXPECT_LE(ls.size(), 6u);
      for (const std::string& line : ls) {
        int a = -1, b = -1, r = -1;
        char op = 0;
        int consumed = 0;
        ASSERT_EQ(std::sscanf(line.c_str(), "%d%c%d=%d%n", &a, &op, &b, &r, &consumed), 4) << line;
        ASSERT_EQ(size_t(consumed), line.size()) << line;
        for (char c : line) ASSERT_TRUE(std::isdigit((unsigned char)c) || c == op || c == '=') << line;
        ASSERT_TRUE(a >= 0 && a <= 99 && b >= 0 && b <= 99) << line;
        ops.insert(op);
        switch (op) {
          case '+': EXPECT_EQ(r, a + b) << line; break;
          case '-': EXPECT_EQ(r, a - b) << line; EXPECT_GE(r, 0) << line; break;
          case '*': EXPECT_EQ(r, a * b) << line; break;
          default: ADD_FAILURE() << "unknown operator in " << line;
        }
        EXPECT_EQ(arithmetic_line({a, op, b}), line) << "canonical spelling (no leading zeros)";
        ++lines;
      }
    }
  }
  EXPECT_GT(docs, 300);
  EXPECT_GT(lines, 1000);
  EXPECT_EQ(ops, (std::set<char>{'+', '-', '*'}));
}

TEST(SyntheticCorpus, GrammarLexiconHasTheAdvertisedSize) {
  const GrammarLexicon& lex = grammar_lexicon();
  EXPECT_EQ(lex.nouns.size(), 40u);
  EXPECT_EQ(lex.verbs.size(), 25u);
  EXPECT_EQ(lex.adjectives.size(), 15u);
  EXPECT_GE(lex.prepositions.size(), 4u);
  EXPECT_GE(lex.names.size(), 8u);
  std::set<std::string_view> nouns, verbs;
  for (const WordForms& n : lex.nouns) {
    EXPECT_NE(n.singular, n.plural);
    nouns.insert(n.singular);
    nouns.insert(n.plural);
  }
  for (const WordForms& v : lex.verbs) {
    EXPECT_NE(v.singular, v.plural);
    verbs.insert(v.singular);
    verbs.insert(v.plural);
  }
  EXPECT_EQ(nouns.size(), 80u) << "noun forms are distinct";
  EXPECT_EQ(verbs.size(), 50u) << "verb forms are distinct";
  for (std::string_view v : verbs) EXPECT_EQ(nouns.count(v), 0u) << v << " is both noun and verb";
}

TEST(SyntheticCorpus, GrammarDocumentsUseTheLexiconAndAgree) {
  const GrammarLexicon& lex = grammar_lexicon();
  enum Number { Singular, Plural, Either };
  std::map<std::string, Number> noun_number, verb_number, det_number;
  for (const WordForms& n : lex.nouns) noun_number[std::string(n.singular)] = Singular,
                                       noun_number[std::string(n.plural)] = Plural;
  for (std::string_view n : lex.names) noun_number[std::string(n)] = Singular;
  for (const WordForms& v : lex.verbs) verb_number[std::string(v.singular)] = Singular,
                                       verb_number[std::string(v.plural)] = Plural;
  for (std::string_view d : lex.singular_determiners) det_number[std::string(d)] = Singular;
  for (std::string_view d : lex.plural_determiners) det_number[std::string(d)] = Plural;
  for (std::string_view d : lex.any_determiners) det_number[std::string(d)] = Either;

  const SyntheticSource src(Split::Eval, 99, 0.0);
  int64_t docs = 0, clauses = 0, plural_subjects = 0, sentences_seen[4] = {0, 0, 0, 0};
  std::set<std::string> seen;
  for (int64_t s = 0; s < 150; ++s) {
    for (const std::string& doc : documents(src.sequence(s, 400))) {
      ++docs;
      ASSERT_FALSE(doc.empty());
      ASSERT_TRUE(doc.size() >= 2 && doc.substr(doc.size() - 2) == " .") << doc;
      ASSERT_EQ(doc.find("  "), std::string::npos) << doc;
      const std::vector<std::string> words = split_on(doc, ' ');
      int sentences = 0;
      // Clauses end at a conjunction or a period; each has a subject head (its first noun or
      // name) that must agree with its first verb.
      std::vector<std::string> clause;
      for (size_t i = 0; i <= words.size(); ++i) {
        const bool end = i == words.size() || words[i] == "." || contains(lex.conjunctions, words[i]);
        if (!end) {
          clause.push_back(words[i]);
          continue;
        }
        if (i < words.size() && words[i] == ".") ++sentences;
        if (i == words.size()) break;
        ASSERT_FALSE(clause.empty()) << doc;
        ++clauses;
        int subject = -1, verb = -1;
        for (const std::string& w : clause) {
          if (subject < 0 && noun_number.count(w)) subject = noun_number[w];
          if (verb < 0 && verb_number.count(w)) verb = verb_number[w];
        }
        ASSERT_GE(subject, 0) << "no subject in: " << doc;
        ASSERT_GE(verb, 0) << "no verb in: " << doc;
        EXPECT_EQ(subject, verb) << "subject-verb agreement in: " << doc;
        plural_subjects += subject == Plural;
        clause.clear();
      }
      ASSERT_GE(sentences, 1);
      ASSERT_LE(sentences, 3);
      ++sentences_seen[sentences];

      for (size_t i = 0; i < words.size(); ++i) {
        const std::string& w = words[i];
        seen.insert(w);
        const bool known = w == "." || noun_number.count(w) || verb_number.count(w) ||
                           det_number.count(w) || contains(lex.adjectives, w) ||
                           contains(lex.prepositions, w) || contains(lex.conjunctions, w);
        ASSERT_TRUE(known) << "'" << w << "' is not in the lexicon: " << doc;
        // A common noun's determiner (one or two words back) agrees with it; "an" before vowels.
        if (noun_number.count(w) && !contains(lex.names, w)) {
          ASSERT_GE(i, 1u) << doc;
          size_t d = i - 1;
          if (contains(lex.adjectives, words[d])) d -= 1;
          ASSERT_TRUE(det_number.count(words[d])) << "no determiner before " << w << ": " << doc;
          const Number dn = det_number[words[d]];
          if (dn != Either) {
            EXPECT_EQ(dn, noun_number[w]) << words[d] << " " << w << ": " << doc;
          }
          const bool vowel = std::string("aeiou").find(words[d + 1][0]) != std::string::npos;
          if (words[d] == "a" || words[d] == "an") {
            EXPECT_EQ(vowel, words[d] == "an") << "a/an before " << words[d + 1] << ": " << doc;
          }
        }
      }
    }
  }
  EXPECT_GT(docs, 300);
  EXPECT_GT(plural_subjects, clauses / 5) << "both numbers occur";
  EXPECT_GT(sentences_seen[1], 0);
  EXPECT_GT(sentences_seen[2], 0);
  EXPECT_GT(sentences_seen[3], 0);
  EXPECT_GT(seen.size(), 150u) << "the documents use most of the vocabulary";
}

TEST(SyntheticCorpus, ArithmeticFractionIsRespected) {
  for (double f : {0.0, 0.25, 0.4, 0.8, 1.0}) {
    const SyntheticSource src(Split::Train, 5, f);
    int64_t docs = 0, arithmetic = 0;
    for (int64_t s = 0; s < 120; ++s) {
      for (const std::string& doc : documents(src.sequence(s, 2048))) {
        ++docs;
        arithmetic += std::isdigit((unsigned char)doc[0]) ? 1 : 0;
      }
    }
    ASSERT_GT(docs, 2000);
    const double share = double(arithmetic) / double(docs);
    std::printf("arithmetic_fraction %.2f: %lld of %lld documents arithmetic (%.3f)\n", f,
                (long long)arithmetic, (long long)docs, share);
    if (f == 0.0 || f == 1.0)
      EXPECT_EQ(share, f);
    else
      EXPECT_NEAR(share, f, 0.03);
  }
  EXPECT_THROW(SyntheticSource(Split::Train, 5, 1.5), fourbit::Error);
  EXPECT_THROW(SyntheticSource(Split::Train, 5, -0.1), fourbit::Error);
}

TEST(SyntheticCorpus, UnigramEntropyIsThatOfAByteLevelCorpus) {
  const SyntheticSource src(Split::Train, 1234, 0.4);
  const Batch x = batch_of(src, 0, 1, 256);
  const std::string text = decode(x.row(0));
  std::printf("sample (first 200 chars of batch 0, row 0):\n%s\n", text.substr(0, 200).c_str());
  std::printf("describe: %s\n", src.describe().c_str());
  const double h = unigram_entropy_nats(src, 16, 16, 128);
  std::printf("unigram entropy of the synthetic corpus (16 batches of 16 x 128): %.4f nats\n", h);
  EXPECT_GT(h, 2.0);
  EXPECT_LT(h, 4.5);
  EXPECT_EQ(h, unigram_entropy_nats(src, 16, 16, 128)) << "deterministic";
}
