package iso4217

import "testing"

func TestCodes(t *testing.T) {
	for _, c := range []string{"EUR", "USD", "JPY", "XCG", "ZWG"} {
		if !Is(c) {
			t.Errorf("Is(%q) = false, want true", c)
		}
	}
	for _, c := range []string{"eur", "ABC", "XXX", "XTS", "XAU", "CHE", "HRK", "ANG", "", "EURO"} {
		if Is(c) {
			t.Errorf("Is(%q) = true, want false", c)
		}
	}
	got := Codes()
	for i := 1; i < len(got); i++ {
		if got[i-1] >= got[i] {
			t.Fatalf("Codes not sorted and distinct at %q, %q", got[i-1], got[i])
		}
	}
	if len(got) < 150 {
		t.Errorf("len(Codes) = %d, want the whole list", len(got))
	}
}
