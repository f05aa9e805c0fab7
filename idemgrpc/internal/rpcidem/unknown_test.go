package rpcidem

import (
	"bytes"
	"math/rand/v2"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
)

// decodedHasUnknown is what HasUnknown must say, read the slow way: b
// decoded into a message of md's type, then every message in it asked
// for its unknown fields. It returns the decoded message too; ok is
// false when b does not decode.
func decodedHasUnknown(t *testing.T, b []byte, md protoreflect.MessageType) (m proto.Message, unknown, ok bool) {
	t.Helper()
	m = md.New().Interface()
	if err := proto.Unmarshal(b, m); err != nil {
		return nil, false, false
	}
	return m, walkUnknown(m.ProtoReflect()), true
}

func walkUnknown(m protoreflect.Message) bool {
	for _, mm := range messagesIn(m) {
		if len(mm.GetUnknown()) > 0 {
			return true
		}
	}
	return false
}

// messagesIn lists m and every message in it (forEachMessage's order).
func messagesIn(m protoreflect.Message) []protoreflect.Message {
	var out []protoreflect.Message
	forEachMessage(m, func(m protoreflect.Message) { out = append(out, m) })
	return out
}

// locationIn returns the SourceCodeInfo.Location among ms, if any.
func locationIn(ms []protoreflect.Message) protoreflect.Message {
	for _, m := range ms {
		if m.Descriptor().FullName() == "google.protobuf.SourceCodeInfo.Location" {
			return m
		}
	}
	return nil
}

// samples are requests of many shapes: scalars, nested messages,
// repeated and packed fields, maps of messages, enums, an Any.
func samples(t *testing.T) []proto.Message {
	t.Helper()
	st, err := structpb.NewStruct(map[string]any{
		"n": 1.5, "s": "x", "b": true, "null": nil,
		"list":   []any{1, "two", map[string]any{"three": []any{3}}},
		"nested": map[string]any{"a": map[string]any{"b": "c"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	any1, err := anypb.New(durationpb.New(1500))
	if err != nil {
		t.Fatal(err)
	}
	fdp := protodesc.ToFileDescriptorProto(structpb.File_google_protobuf_struct_proto)
	fdp.SourceCodeInfo = &descriptorpb.SourceCodeInfo{Location: []*descriptorpb.SourceCodeInfo_Location{
		{Path: []int32{4, 0, 2, 1}, Span: []int32{10, 2, 30}, LeadingComments: proto.String("c")},
	}}
	return []proto.Message{st, any1, durationpb.New(-42), fdp, new(structpb.Struct), structpb.NewListValue(&structpb.ListValue{})}
}

// HasUnknown, reading the encoding, says what decoding it and walking
// the messages says, and Fingerprinted of the decoded message is its
// encoding without its unknown fields: for requests of many shapes as they are, and with
// unknown bytes put in one of their messages (a number the type lacks, a
// known number with a wire type it cannot take, a repeated scalar in the
// other, packed or unpacked, form, which is known).
func TestHasUnknownAgreesWithTheDecodedMessage(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	det := proto.MarshalOptions{Deterministic: true}
	var unknown, known int
	for _, sample := range samples(t) {
		mt := sample.ProtoReflect().Type()
		b, err := det.Marshal(sample)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := HasUnknown(b, mt.Descriptor()), false; got != want {
			t.Errorf("%s as it is: HasUnknown = %v, want %v", mt.Descriptor().FullName(), got, want)
		}
		for range 300 {
			m := proto.Clone(sample)
			all := messagesIn(m.ProtoReflect())
			target := all[rng.IntN(len(all))]
			if loc := locationIn(all); loc != nil && rng.IntN(4) == 0 {
				target = loc // the one message with repeated scalars
			}
			target.SetUnknown(append(target.GetUnknown(), extraField(rng, target.Descriptor())...))
			b, err := det.Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			decoded, want, ok := decodedHasUnknown(t, b, mt)
			if !ok {
				continue // not a valid encoding: Fingerprinted never reads one
			}
			if want {
				unknown++
			} else {
				known++
			}
			if got := HasUnknown(b, mt.Descriptor()); got != want {
				t.Fatalf("%s with %x in a %s: HasUnknown = %v, the decoded message says %v", mt.Descriptor().FullName(),
					target.GetUnknown(), target.Descriptor().FullName(), got, want)
			}
			fp, err := Fingerprinted(decoded)
			if err != nil {
				t.Fatal(err)
			}
			if want := knownEncoding(t, decoded, protoregistry.GlobalTypes); !bytes.Equal(fp, want) {
				t.Fatalf("%s with %x in a %s: Fingerprinted = %x, want %x", mt.Descriptor().FullName(),
					target.GetUnknown(), target.Descriptor().FullName(), fp, want)
			}
		}
	}
	t.Logf("%d encodings with unknown fields, %d without", unknown, known)
	if unknown == 0 || known == 0 {
		t.Errorf("the cases did not cover both answers (%d unknown, %d known)", unknown, known)
	}
}

// extraField is one field's encoding for a message of md's type: a
// number md lacks, a known number with another wire type, or a known
// repeated scalar packed or not.
func extraField(rng *rand.Rand, md protoreflect.MessageDescriptor) []byte {
	var b []byte
	fields := md.Fields()
	switch rng.IntN(3) {
	case 0: // a number md lacks
		num := protowire.Number(1000 + rng.IntN(1000))
		b = protowire.AppendTag(b, num, protowire.VarintType)
		return protowire.AppendVarint(b, rng.Uint64N(300))
	case 1: // a known number, another wire type
		if fields.Len() == 0 {
			return protowire.AppendVarint(protowire.AppendTag(b, 7, protowire.VarintType), 1)
		}
		fd := fields.Get(rng.IntN(fields.Len()))
		if fd.Kind() == protoreflect.MessageKind || fd.Kind() == protoreflect.StringKind || fd.Kind() == protoreflect.BytesKind {
			return protowire.AppendFixed32(protowire.AppendTag(b, fd.Number(), protowire.Fixed32Type), 9)
		}
		return protowire.AppendString(protowire.AppendTag(b, fd.Number(), protowire.BytesType), "zz")
	default: // a repeated varint field, packed or not (known); else a varint field
		for i := 0; i < fields.Len(); i++ {
			fd := fields.Get(i)
			if fd.IsList() && fd.Kind() == protoreflect.Int32Kind {
				if rng.IntN(2) == 0 {
					return protowire.AppendVarint(protowire.AppendTag(b, fd.Number(), protowire.VarintType), 5)
				}
				packed := protowire.AppendVarint(protowire.AppendVarint(nil, 5), 6)
				return protowire.AppendBytes(protowire.AppendTag(b, fd.Number(), protowire.BytesType), packed)
			}
		}
		return nil // none: the message as it is
	}
}

// Fingerprinted allocates nothing beyond the encoding for a request
// without unknown fields, whatever its shape.
func TestFingerprintedAllocatesTheEncodingAlone(t *testing.T) {
	st, err := structpb.NewStruct(map[string]any{"a": map[string]any{"b": []any{1, "x", map[string]any{"c": true}}}})
	if err != nil {
		t.Fatal(err)
	}
	det := proto.MarshalOptions{Deterministic: true}
	plain := testing.AllocsPerRun(200, func() { _, _ = det.Marshal(st) })
	got := testing.AllocsPerRun(200, func() { _, _ = Fingerprinted(st) })
	if got != plain {
		t.Errorf("Fingerprinted: %v allocations, the deterministic encoding alone %v", got, plain)
	}
}
