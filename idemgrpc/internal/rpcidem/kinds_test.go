package rpcidem

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
)

// kindsFile is a file of one message type, p.M, with a field of every
// scalar kind singular, repeated, packed and unpacked, an enum, messages,
// maps of messages and of enums and a oneof; in proto2 also groups and
// extensions x100 (int32), x101 (message), x102 (packed sint64) and x103
// (message).
func kindsFile(t *testing.T, syntax string) protoreflect.FileDescriptor {
	t.Helper()
	kinds := []string{"INT32", "INT64", "UINT32", "UINT64", "SINT32", "SINT64", "FIXED32", "FIXED64", "SFIXED32", "SFIXED64", "FLOAT", "DOUBLE", "BOOL", "STRING", "BYTES"}
	var fields string
	n := 1
	for _, k := range kinds {
		lab := "LABEL_OPTIONAL"
		fields += fmt.Sprintf("field { name: \"s%d\" number: %d label: %s type: TYPE_%s }\n", n, n, lab, k)
		n++
		fields += fmt.Sprintf("field { name: \"r%d\" number: %d label: LABEL_REPEATED type: TYPE_%s }\n", n, n, k)
		n++
		if k != "STRING" && k != "BYTES" {
			fields += fmt.Sprintf("field { name: \"p%d\" number: %d label: LABEL_REPEATED type: TYPE_%s options { packed: true } }\n", n, n, k)
			n++
			fields += fmt.Sprintf("field { name: \"u%d\" number: %d label: LABEL_REPEATED type: TYPE_%s options { packed: false } }\n", n, n, k)
			n++
		}
	}
	fields += `
field { name: "e" number: 60 label: LABEL_OPTIONAL type: TYPE_ENUM type_name: ".p.E" }
field { name: "re" number: 61 label: LABEL_REPEATED type: TYPE_ENUM type_name: ".p.E" }
field { name: "pe" number: 62 label: LABEL_REPEATED type: TYPE_ENUM type_name: ".p.E" options { packed: true } }
field { name: "m" number: 63 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".p.M" }
field { name: "rm" number: 64 label: LABEL_REPEATED type: TYPE_MESSAGE type_name: ".p.M" }
field { name: "mm" number: 65 label: LABEL_REPEATED type: TYPE_MESSAGE type_name: ".p.M.MmEntry" }
field { name: "me" number: 66 label: LABEL_REPEATED type: TYPE_MESSAGE type_name: ".p.M.MeEntry" }
field { name: "oi" number: 67 label: LABEL_OPTIONAL type: TYPE_INT32 oneof_index: 0 }
field { name: "om" number: 68 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".p.M" oneof_index: 0 }
field { name: "os" number: 69 label: LABEL_OPTIONAL type: TYPE_STRING oneof_index: 0 }
OE
oneof_decl { name: "o" }
nested_type { name: "MmEntry" options { map_entry: true }
  field { name: "key" number: 1 label: LABEL_OPTIONAL type: TYPE_STRING }
  field { name: "value" number: 2 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".p.M" } }
nested_type { name: "MeEntry" options { map_entry: true }
  field { name: "key" number: 1 label: LABEL_OPTIONAL type: TYPE_INT32 }
  field { name: "value" number: 2 label: LABEL_OPTIONAL type: TYPE_ENUM type_name: ".p.E" } }
`
	extra := ""
	exts := ""
	if syntax == "proto2" {
		extra = `
field { name: "g" number: 70 label: LABEL_OPTIONAL type: TYPE_GROUP type_name: ".p.M.G" }
field { name: "rg" number: 71 label: LABEL_REPEATED type: TYPE_GROUP type_name: ".p.M.Rg" }
nested_type { name: "G" field { name: "a" number: 1 label: LABEL_OPTIONAL type: TYPE_INT32 } field { name: "m" number: 2 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".p.M" } }
nested_type { name: "Rg" field { name: "a" number: 1 label: LABEL_OPTIONAL type: TYPE_INT32 } field { name: "m" number: 2 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".p.M" } }
extension_range { start: 100 end: 200 }
`
		exts = `
extension { name: "x100" number: 100 label: LABEL_OPTIONAL type: TYPE_INT32 extendee: ".p.M" }
extension { name: "x101" number: 101 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".p.M" extendee: ".p.M" }
extension { name: "x102" number: 102 label: LABEL_REPEATED type: TYPE_SINT64 extendee: ".p.M" options { packed: true } }
extension { name: "x103" number: 103 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".p.M" extendee: ".p.M" }
`
	}
	oe := ""
	if syntax == "proto2" {
		oe = `field { name: "oe" number: 72 label: LABEL_OPTIONAL type: TYPE_ENUM type_name: ".p.E" oneof_index: 0 }`
	}
	fields = strings.Replace(fields, "OE", oe, 1)
	enumDecl := `enum_type { name: "E" value { name: "E0" number: 0 } value { name: "E1" number: 1 } value { name: "E5" number: 5 } }`
	return fileOf(t, fmt.Sprintf(`name: "p%s.proto" package: "p" syntax: %q %s message_type { name: "M" %s %s } %s`, syntax, syntax, enumDecl, fields, extra, exts))
}

// fileOf is the file a FileDescriptorProto in text format describes.
func fileOf(t testing.TB, src string) protoreflect.FileDescriptor {
	t.Helper()
	fdp := new(descriptorpb.FileDescriptorProto)
	if err := prototext.Unmarshal([]byte(src), fdp); err != nil {
		t.Fatal(err)
	}
	fd, err := protodesc.NewFile(fdp, nil)
	if err != nil {
		t.Fatal(err)
	}
	return fd
}

// gen writes random encodings of a message type: its fields, mostly with
// their wire type (a repeated scalar packed or not), sometimes another;
// numbers of its extension range and numbers it lacks; map entries with a
// key or value missing or a third field.
type gen struct {
	rng   *rand.Rand
	depth int
	exts  *protoregistry.Types
}

func (g *gen) value(b []byte, kind protoreflect.Kind, md protoreflect.MessageDescriptor, num protowire.Number) []byte {
	switch kind {
	case protoreflect.MessageKind:
		return protowire.AppendBytes(b, g.msg(md))
	case protoreflect.GroupKind:
		b = append(b, g.msg(md)...)
		return protowire.AppendTag(b, num, protowire.EndGroupType)
	case protoreflect.StringKind, protoreflect.BytesKind:
		return protowire.AppendString(b, []string{"", "a", "bc"}[g.rng.IntN(3)])
	case protoreflect.Fixed32Kind, protoreflect.Sfixed32Kind, protoreflect.FloatKind:
		return protowire.AppendFixed32(b, g.rng.Uint32N(4))
	case protoreflect.Fixed64Kind, protoreflect.Sfixed64Kind, protoreflect.DoubleKind:
		return protowire.AppendFixed64(b, g.rng.Uint64N(4))
	default:
		return protowire.AppendVarint(b, []uint64{0, 1, 2, 5, 7, 300, 1 << 63}[g.rng.IntN(7)])
	}
}

func wtOf(k protoreflect.Kind) protowire.Type {
	switch k {
	case protoreflect.MessageKind, protoreflect.StringKind, protoreflect.BytesKind:
		return protowire.BytesType
	case protoreflect.GroupKind:
		return protowire.StartGroupType
	case protoreflect.Fixed32Kind, protoreflect.Sfixed32Kind, protoreflect.FloatKind:
		return protowire.Fixed32Type
	case protoreflect.Fixed64Kind, protoreflect.Sfixed64Kind, protoreflect.DoubleKind:
		return protowire.Fixed64Type
	}
	return protowire.VarintType
}

var anyKinds = []protoreflect.Kind{protoreflect.Int32Kind, protoreflect.Fixed32Kind, protoreflect.Fixed64Kind, protoreflect.StringKind, protoreflect.GroupKind}

func (g *gen) msg(md protoreflect.MessageDescriptor) []byte {
	g.depth++
	defer func() { g.depth-- }()
	var b []byte
	count := g.rng.IntN(6)
	if g.depth > 3 {
		count = g.rng.IntN(2)
	}
	for range count {
		r := g.rng.IntN(20)
		var num protowire.Number
		var fd protoreflect.FieldDescriptor
		switch {
		case r == 0:
			num = protowire.Number(100 + g.rng.IntN(6)) // extension range (some registered)
		case r == 1:
			num = protowire.Number(500 + g.rng.IntN(3)) // unknown
		default:
			if md.Fields().Len() == 0 {
				num = 9
			} else {
				fd = md.Fields().Get(g.rng.IntN(md.Fields().Len()))
				num = fd.Number()
			}
		}
		if fd == nil {
			fd = md.Fields().ByNumber(num)
		}
		if fd == nil && md.ExtensionRanges().Has(num) && g.exts != nil {
			if xt, err := g.exts.FindExtensionByNumber(md.FullName(), num); err == nil {
				fd = xt.TypeDescriptor()
			}
		}
		if fd == nil || g.rng.IntN(8) == 0 || g.depth > 4 && (fd.Kind() == protoreflect.MessageKind || fd.Kind() == protoreflect.GroupKind) {
			// arbitrary field
			k := anyKinds[g.rng.IntN(len(anyKinds))]
			if g.depth > 4 && k == protoreflect.GroupKind {
				k = protoreflect.Int32Kind
			}
			b = protowire.AppendTag(b, num, wtOf(k))
			b = g.value(b, k, md, num)
			continue
		}
		switch {
		case fd.IsMap():
			var e []byte
			for _, f := range []protoreflect.FieldDescriptor{fd.MapKey(), fd.MapValue()} {
				if g.rng.IntN(5) == 0 {
					continue
				}
				e = protowire.AppendTag(e, f.Number(), wtOf(f.Kind()))
				e = g.value(e, f.Kind(), f.Message(), f.Number())
			}
			if g.rng.IntN(5) == 0 {
				e = protowire.AppendVarint(protowire.AppendTag(e, 3, protowire.VarintType), 1)
			}
			b = protowire.AppendTag(b, num, protowire.BytesType)
			b = protowire.AppendBytes(b, e)
		case fd.IsList() && wtOf(fd.Kind()) != protowire.BytesType && wtOf(fd.Kind()) != protowire.StartGroupType && g.rng.IntN(2) == 0:
			var p []byte
			for range g.rng.IntN(4) {
				p = g.value(p, fd.Kind(), nil, num)
			}
			b = protowire.AppendTag(b, num, protowire.BytesType)
			b = protowire.AppendBytes(b, p)
		default:
			b = protowire.AppendTag(b, num, wtOf(fd.Kind()))
			b = g.value(b, fd.Kind(), fd.Message(), num)
		}
	}
	return b
}

// knownEncoding is what Fingerprinted must return for m, decoded with
// the resolver exts: m's deterministic encoding without its unknown
// fields, read the slow way (encoded, decoded with the same resolver
// dropping unknown fields, encoded again).
func knownEncoding(t *testing.T, m proto.Message, exts *protoregistry.Types) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	known := m.ProtoReflect().New().Interface()
	if err := (proto.UnmarshalOptions{DiscardUnknown: true, Resolver: exts}).Unmarshal(b, known); err != nil {
		t.Fatal(err)
	}
	out, err := proto.MarshalOptions{Deterministic: true}.Marshal(known)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// kindsTypes returns p.M of kindsFile and, for proto2, a resolver that
// knows extensions x100 and x101 (not x102, x103), registered nowhere
// else: the decoder's own, as a server built on dynamic types has.
func kindsTypes(t *testing.T, syntax string) (protoreflect.MessageDescriptor, *protoregistry.Types) {
	t.Helper()
	fd := kindsFile(t, syntax)
	exts := new(protoregistry.Types)
	if syntax == "proto2" {
		for _, name := range []protoreflect.Name{"x100", "x101"} {
			if err := exts.RegisterExtension(dynamicpb.NewExtensionType(fd.Extensions().ByName(name))); err != nil {
				t.Fatal(err)
			}
		}
	}
	return fd.Messages().ByName("M"), exts
}

// HasUnknown finds every unknown field the decoder keeps, whatever the
// field's kind, packing, oneof, map or group around it, in proto2 and
// proto3; it may say yes without one only for an extension (it does not
// know which ones the decoder resolved). Fingerprinted is the encoding of
// the known fields, the extensions the decoder resolved among them.
func TestHasUnknownAgreesForEveryFieldKind(t *testing.T) {
	det := proto.MarshalOptions{Deterministic: true}
	for _, syntax := range []string{"proto2", "proto3"} {
		md, exts := kindsTypes(t, syntax)
		mt := dynamicpb.NewMessageType(md)
		g := &gen{rng: rand.New(rand.NewPCG(3, 4)), exts: exts}
		var unknown, known int
		for range 3000 {
			in := g.msg(md)
			m := mt.New().Interface()
			if err := (proto.UnmarshalOptions{Resolver: exts}).Unmarshal(in, m); err != nil {
				continue
			}
			b, err := det.Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			want := walkUnknown(m.ProtoReflect())
			if want {
				unknown++
			} else {
				known++
			}
			got := HasUnknown(b, md)
			if got != want && (!got || !hasExtension(m.ProtoReflect())) {
				t.Fatalf("%s: %x decoded, encoded %x: HasUnknown = %v, the decoded message says %v:\n%v", syntax, in, b, got, want, prototext.Format(m))
			}
			fp, err := Fingerprinted(m)
			if err != nil {
				t.Fatalf("%s: %x decoded: Fingerprinted: %v", syntax, in, err)
			}
			if want := knownEncoding(t, m, exts); !bytes.Equal(fp, want) {
				t.Fatalf("%s: %x decoded: Fingerprinted = %x, want %x:\n%v", syntax, in, fp, want, prototext.Format(m))
			}
		}
		t.Logf("%s: %d decoded with unknown fields, %d without", syntax, unknown, known)
		if unknown == 0 || known == 0 {
			t.Errorf("%s: the cases did not cover both answers (%d unknown, %d known)", syntax, unknown, known)
		}
	}
}

// hasExtension reports whether m, or a message in it, has an extension set.
func hasExtension(m protoreflect.Message) bool {
	for _, mm := range messagesIn(m) {
		found := false
		mm.Range(func(fd protoreflect.FieldDescriptor, _ protoreflect.Value) bool {
			found = fd.IsExtension()
			return !found
		})
		if found {
			return true
		}
	}
	return false
}

// Two requests that differ only in an extension the server's decoder
// resolved (one not in the global registry, as a server built on dynamic
// types, or with its own codec, resolves) are two requests: their
// extension is in their Fingerprinted, with or without unknown fields
// elsewhere, and is not lost to a decoding that resolves none.
func TestFingerprintedKeepsTheExtensionsTheDecoderResolved(t *testing.T) {
	md, exts := kindsTypes(t, "proto2")
	x101, err := exts.FindExtensionByName("p.x101")
	if err != nil {
		t.Fatal(err)
	}
	request := func(v int32, unknown bool) proto.Message {
		inner := dynamicpb.NewMessage(md)
		inner.Set(md.Fields().ByName("s1"), protoreflect.ValueOfInt32(v))
		m := dynamicpb.NewMessage(md)
		m.Set(x101.TypeDescriptor(), protoreflect.ValueOfMessage(inner))
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if unknown {
			b = protowire.AppendVarint(protowire.AppendTag(b, 500, protowire.VarintType), 1)
		}
		out := dynamicpb.NewMessage(md)
		if err := (proto.UnmarshalOptions{Resolver: exts}).Unmarshal(b, out); err != nil {
			t.Fatal(err)
		}
		return out
	}
	for _, unknown := range []bool{false, true} {
		one, err := Fingerprinted(request(1, unknown))
		if err != nil {
			t.Fatal(err)
		}
		two, err := Fingerprinted(request(2, unknown))
		if err != nil {
			t.Fatal(err)
		}
		if bytes.Equal(one, two) {
			t.Errorf("unknown fields %v: x101 {s1: 1} and x101 {s1: 2}: the same Fingerprinted %x", unknown, one)
		}
		if want := knownEncoding(t, request(1, unknown), exts); !bytes.Equal(one, want) {
			t.Errorf("unknown fields %v: Fingerprinted = %x, want %x", unknown, one, want)
		}
	}
}

// deepGroups is a type whose field child is itself, delimited (a group,
// in editions), and an encoding of depth nested children around fields
// strings; with unknown, an unknown field in the innermost.
func deepGroups(t testing.TB, depth, fields int, unknown bool) ([]byte, protoreflect.MessageDescriptor) {
	t.Helper()
	src := `name: "deep.proto" package: "d" syntax: "editions" edition: EDITION_2023
message_type { name: "Node"
  field { name: "child" number: 1 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".d.Node" options { features { message_encoding: DELIMITED } } }
  field { name: "s" number: 2 label: LABEL_REPEATED type: TYPE_STRING } }`
	fd := fileOf(t, src)
	var b []byte
	for range depth {
		b = protowire.AppendTag(b, 1, protowire.StartGroupType)
	}
	for range fields {
		b = protowire.AppendString(protowire.AppendTag(b, 2, protowire.BytesType), "")
	}
	if unknown {
		b = protowire.AppendVarint(protowire.AppendTag(b, 3, protowire.VarintType), 1)
	}
	for range depth {
		b = protowire.AppendTag(b, 1, protowire.EndGroupType)
	}
	return b, fd.Messages().ByName("Node")
}

// Groups nested 2,000 deep around 20,000 fields: HasUnknown finds an
// unknown field in the innermost, and none without it. (Reading each
// group once more for every group around it made this 44 kB request cost
// 0.36 s: BenchmarkHasUnknownNestedGroups sets it against one pass over
// the bytes.)
func TestHasUnknownInDeeplyNestedGroups(t *testing.T) {
	for _, unknown := range []bool{false, true} {
		b, md := deepGroups(t, 2000, 20000, unknown)
		if got := HasUnknown(b, md); got != unknown {
			t.Errorf("unknown field in the innermost group %v: HasUnknown = %v", unknown, got)
		}
	}
}

// BenchmarkHasUnknownNestedGroups: HasUnknown on 2,000 nested groups
// around 20,000 fields, and, as the baseline, one pass over the same
// bytes (protowire.ConsumeFieldValue of the outermost group). Their ratio
// is HasUnknown's cost per byte read once; it grew with the depth while
// HasUnknown read a group's bytes again for each group around it.
func BenchmarkHasUnknownNestedGroups(b *testing.B) {
	enc, md := deepGroups(b, 2000, 20000, false)
	b.Run("HasUnknown", func(b *testing.B) {
		for b.Loop() {
			HasUnknown(enc, md)
		}
	})
	b.Run("one-pass", func(b *testing.B) {
		for b.Loop() {
			protowire.ConsumeFieldValue(1, protowire.StartGroupType, enc[1:])
		}
	})
}

// An encoding HasUnknown cannot parse counts as holding an unknown field
// (the caller then drops them from a copy of the message): a group
// without its end, ended by another number's tag, an end-group tag
// outside any, a cut tag or value.
func TestHasUnknownCountsAnUnparsableEncoding(t *testing.T) {
	md, _ := kindsTypes(t, "proto2")
	g := md.Fields().ByName("g").Number()
	start := protowire.AppendTag(nil, g, protowire.StartGroupType)
	for name, b := range map[string][]byte{
		"group without its end":  start,
		"group ended by another": protowire.AppendTag(start, g+1, protowire.EndGroupType),
		"end group outside any":  protowire.AppendTag(nil, g, protowire.EndGroupType),
		"end group in a message": protowire.AppendBytes(protowire.AppendTag(nil, md.Fields().ByName("m").Number(), protowire.BytesType), protowire.AppendTag(nil, g, protowire.EndGroupType)),
		"cut tag":                {0x80},
		"cut value":              protowire.AppendTag(nil, md.Fields().ByName("s1").Number(), protowire.VarintType),
		"cut group field":        append(start[:len(start):len(start)], protowire.AppendTag(nil, 1, protowire.Fixed64Type)...),
	} {
		if !HasUnknown(b, md) {
			t.Errorf("%s (%x): HasUnknown = false, want true", name, b)
		}
	}
	ok := protowire.AppendTag(protowire.AppendVarint(protowire.AppendTag(start, 1, protowire.VarintType), 7), g, protowire.EndGroupType)
	if HasUnknown(ok, md) {
		t.Errorf("a group with a known field (%x): HasUnknown = true, want false", ok)
	}
}
